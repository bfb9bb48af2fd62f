package memlimit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeFiles(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for name, body := range files {
		p := filepath.Join(root, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestFromCgroup(t *testing.T) {
	for _, tc := range []struct {
		name     string
		self     string
		files    map[string]string
		want     int64
		wantFile string
		wantErr  string
	}{
		{name: "v2 container limit", self: "0::/kubepods/pod1/ctr\n",
			files: map[string]string{"kubepods/pod1/ctr/memory.max": "268435456\n", "kubepods/pod1/memory.max": "max\n"},
			want:  268435456, wantFile: "kubepods/pod1/ctr/memory.max"},
		{name: "v2 the pod's limit is tighter than the container's", self: "0::/kubepods/pod1/ctr\n",
			files: map[string]string{"kubepods/pod1/ctr/memory.max": "536870912", "kubepods/pod1/memory.max": "134217728"},
			want:  134217728, wantFile: "kubepods/pod1/memory.max"},
		{name: "v2 no limit anywhere", self: "0::/system.slice/kpp.service\n",
			files: map[string]string{"system.slice/kpp.service/memory.max": "max"}},
		{name: "v2 root cgroup without limit files", self: "0::/\n"},
		{name: "v1 memory controller", self: "12:cpu,cpuacct:/x\n4:memory:/kubepods/pod2\n0::/\n",
			files: map[string]string{"memory/kubepods/pod2/memory.limit_in_bytes": "104857600", "memory/memory.limit_in_bytes": "9223372036854771712"},
			want:  104857600, wantFile: "memory/kubepods/pod2/memory.limit_in_bytes"},
		{name: "v1 unlimited", self: "4:memory:/\n",
			files: map[string]string{"memory/memory.limit_in_bytes": "9223372036854771712"}},
		{name: "garbage in a limit file", self: "0::/a\n",
			files: map[string]string{"a/memory.max": "lots"}, wantErr: `"lots" is neither a byte count nor "max"`},
		{name: "garbage in /proc/self/cgroup", self: "nonsense\n", wantErr: "is not id:controllers:path"},
		{name: "empty /proc/self/cgroup"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			writeFiles(t, root, tc.files)
			got, err := FromCgroup([]byte(tc.self), root)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Bytes != tc.want {
				t.Fatalf("limit %d, want %d", got.Bytes, tc.want)
			}
			if tc.wantFile != "" && got.File != filepath.Join(root, filepath.FromSlash(tc.wantFile)) {
				t.Fatalf("file %s, want %s", got.File, tc.wantFile)
			}
		})
	}
}

func TestSoftLeavesATenth(t *testing.T) {
	if got := Soft(256 << 20); got != 241591905 {
		t.Fatalf("Soft(256 MiB) = %d", got)
	}
}

// The process's own cgroup: whatever the machine, reading it must not fail.
func TestFromCgroupOfThisProcess(t *testing.T) {
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Skipf("no /proc/self/cgroup: %v", err)
	}
	l, err := FromCgroup(self, "/sys/fs/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("this process's cgroup memory limit: %d bytes (%s)", l.Bytes, l.File)
}
