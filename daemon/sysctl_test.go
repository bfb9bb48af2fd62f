package daemon

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
)

// These tests never touch the real /proc/sys: sysctls are files in a temporary directory.

func TestConntrackSysctls(t *testing.T) {
	tests := []struct {
		name string
		args []string
		cpus int
		want []sysctlValue
	}{{
		name: "kube_proxy_defaults_on_8_cpus",
		cpus: 8,
		want: []sysctlValue{
			{"net/netfilter/nf_conntrack_max", 262144},
			{"net/netfilter/nf_conntrack_tcp_timeout_established", 86400},
			{"net/netfilter/nf_conntrack_tcp_timeout_close_wait", 3600},
		},
	}, {
		name: "min_wins_on_a_small_node",
		cpus: 2,
		want: []sysctlValue{
			{"net/netfilter/nf_conntrack_max", 131072},
			{"net/netfilter/nf_conntrack_tcp_timeout_established", 86400},
			{"net/netfilter/nf_conntrack_tcp_timeout_close_wait", 3600},
		},
	}, {
		name: "zero_leaves_everything_as_it_is",
		args: []string{"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0"},
		cpus: 8,
	}, {
		name: "udp_timeouts_and_liberal_tcp",
		args: []string{"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=90s",
			"--conntrack-udp-timeout=30s", "--conntrack-udp-timeout-stream=2m", "--conntrack-tcp-be-liberal"},
		cpus: 8,
		want: []sysctlValue{
			{"net/netfilter/nf_conntrack_tcp_timeout_close_wait", 90},
			{"net/netfilter/nf_conntrack_udp_timeout", 30},
			{"net/netfilter/nf_conntrack_udp_timeout_stream", 120},
			{"net/netfilter/nf_conntrack_tcp_be_liberal", 1},
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, _, err := parseOptions(tt.args)
			if err != nil {
				t.Fatal(err)
			}
			got := conntrackSysctls(o, tt.cpus)
			if diff := cmp.Diff(tt.want, got, cmp.AllowUnexported(sysctlValue{})); diff != "" {
				t.Errorf("sysctls (-want +got):\n%s", diff)
			}
		})
	}
}

// fakeProcSys makes a /proc/sys with the given files and values.
func fakeProcSys(t *testing.T, files map[string]string) procSys {
	t.Helper()
	root := t.TempDir()
	for name, v := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return procSys(root)
}

func TestApplySysctlsWritesOnlyWhatDiffers(t *testing.T) {
	sys := fakeProcSys(t, map[string]string{
		"net/netfilter/nf_conntrack_max":                     "262144\n",
		"net/netfilter/nf_conntrack_tcp_timeout_established": "432000\n",
	})
	log, hook := logtest.NewNullLogger()
	changed := applySysctls(sys, []sysctlValue{
		{"net/netfilter/nf_conntrack_max", 262144},
		{"net/netfilter/nf_conntrack_tcp_timeout_established", 86400},
		{"net/netfilter/nf_conntrack_tcp_timeout_close_wait", 3600}, // module parameter missing
	}, log)
	if changed != 1 {
		t.Errorf("changed = %d, want 1", changed)
	}
	for name, want := range map[string]int{
		"net/netfilter/nf_conntrack_max":                     262144,
		"net/netfilter/nf_conntrack_tcp_timeout_established": 86400,
	} {
		if got, err := sys.get(name); err != nil || got != want {
			t.Errorf("%s = %d, %v; want %d", name, got, err, want)
		}
	}
	if _, err := os.Stat(filepath.Join(string(sys), "net/netfilter/nf_conntrack_tcp_timeout_close_wait")); !os.IsNotExist(err) {
		t.Errorf("a missing sysctl was created (stat: %v)", err)
	}
	var got []string
	for _, e := range hook.AllEntries() {
		got = append(got, e.Level.String()+" "+e.Data["sysctl"].(string)+": "+e.Message)
	}
	want := []string{
		"info net/netfilter/nf_conntrack_tcp_timeout_established: Set sysctl",
		"warning net/netfilter/nf_conntrack_tcp_timeout_close_wait: Cannot set sysctl (is the nf_conntrack module loaded?)",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("log (-want +got):\n%s", diff)
	}
}

func TestSetOOMScoreAdj(t *testing.T) {
	tests := []struct {
		name     string
		current  string // "" means the file is missing
		value    int32
		wantFile string
		wantLog  []string
	}{
		{"lowers_the_score", "0\n", -999, "-999", []string{"info: Set the OOM score adjustment"}},
		{"already_set_writes_nothing", "-999\n", -999, "-999\n", nil},
		{"failure_is_logged_not_fatal", "", -999, "", []string{"warning: Cannot set the OOM score adjustment"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "oom_score_adj")
			if tt.current != "" {
				if err := os.WriteFile(path, []byte(tt.current), 0o644); err != nil {
					t.Fatal(err)
				}
			} else {
				path = filepath.Join(path, "not-a-dir", "oom_score_adj")
			}
			log, hook := logtest.NewNullLogger()
			log.SetLevel(logrus.DebugLevel)
			setOOMScoreAdj(path, tt.value, log)
			var got []string
			for _, e := range hook.AllEntries() {
				got = append(got, e.Level.String()+": "+e.Message)
			}
			if diff := cmp.Diff(tt.wantLog, got); diff != "" {
				t.Errorf("log (-want +got):\n%s", diff)
			}
			if tt.wantFile != "" {
				b, err := os.ReadFile(path)
				if err != nil || string(b) != tt.wantFile {
					t.Errorf("file = %q, %v; want %q", b, err, tt.wantFile)
				}
			}
		})
	}
}

// TestApplyConntrackSysctlsFromConfig follows a config file down to the values written.
func TestApplyConntrackSysctlsFromConfig(t *testing.T) {
	o, _, err := parseOptions([]string{"--config=testdata/config/kubeadm-cluster.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{}
	for _, v := range conntrackSysctls(o, 4) {
		files[v.name] = "0"
	}
	sys := fakeProcSys(t, files)
	log, _ := logtest.NewNullLogger()
	if n := applySysctls(sys, conntrackSysctls(o, 4), log); n != 6 {
		t.Errorf("changed %d sysctls, want 6", n)
	}
	want := map[string]int{
		"nf_conntrack_max":                     262144, // max(65536*4, 262144)
		"nf_conntrack_tcp_timeout_established": 43200,
		"nf_conntrack_tcp_timeout_close_wait":  1800,
		"nf_conntrack_tcp_be_liberal":          1,
		"nf_conntrack_udp_timeout":             30,
		"nf_conntrack_udp_timeout_stream":      120,
	}
	for name, w := range want {
		if v, err := sys.get("net/netfilter/" + name); err != nil || v != w {
			t.Errorf("%s = %d, %v; want %d", name, v, err, w)
		}
	}
}
