package daemon

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/memlimit"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

const memLimitChildEnv = "KPP_MEMLIMIT_CHILD"

// TestMemoryLimitChild is the child of TestMemoryLimitFromARealCgroup: it applies the daemon's
// memory limit and prints what the runtime's limit became. Without the variable it does nothing.
func TestMemoryLimitChild(t *testing.T) {
	if os.Getenv(memLimitChildEnv) == "" {
		return
	}
	log := logrus.New()
	log.SetOutput(os.Stdout)
	applyMemoryLimit(log)
	fmt.Printf("runtime memory limit=%d\n", debug.SetMemoryLimit(-1))
}

// memoryCgroupParent returns a directory where a memory cgroup with a limit can be made: the v1
// memory controller's root, or the v2 root when its children get the memory controller.
func memoryCgroupParent() (dir, limitFile string, ok bool) {
	if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err == nil {
		return "/sys/fs/cgroup/memory", "memory.limit_in_bytes", true
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/cgroup.subtree_control"); err == nil && strings.Contains(string(b), "memory") {
		return "/sys/fs/cgroup", "memory.max", true
	}
	return "", "", false
}

// TestMemoryLimitFromARealCgroup runs a child in a real memory cgroup limited to 256 MiB: the
// daemon's start gives its runtime a soft limit of nine tenths of that, and leaves a GOMEMLIMIT
// the operator set alone.
func TestMemoryLimitFromARealCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.Unavailable(t, "making a memory cgroup needs root")
	}
	parent, limitFile, ok := memoryCgroupParent()
	if !ok {
		testenv.Unavailable(t, "no writable memory cgroup controller (v1 memory or v2 with memory in the root's subtree_control)")
	}
	cg := filepath.Join(parent, fmt.Sprintf("kpp-memlimit-test-%d", os.Getpid()))
	if err := os.Mkdir(cg, 0o755); err != nil {
		testenv.Unavailable(t, "cannot make a memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		if err := os.Remove(cg); err != nil {
			t.Errorf("remove the test cgroup %s: %v", cg, err)
		}
	})
	const hard = 256 << 20
	if err := os.WriteFile(filepath.Join(cg, limitFile), []byte(fmt.Sprint(hard)), 0o644); err != nil {
		t.Fatalf("set the test cgroup's limit: %v", err)
	}
	run := func(env ...string) string {
		t.Helper()
		// The shell moves itself into the cgroup, then becomes the child: the child is in it from
		// its first instruction.
		cmd := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && exec "$0" -test.run='^TestMemoryLimitChild$' -test.count=1`, os.Args[0], cg)
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "GOMEMLIMIT=") {
				cmd.Env = append(cmd.Env, kv)
			}
		}
		cmd.Env = append(cmd.Env, append(env, memLimitChildEnv+"=1")...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		return string(out)
	}

	out := run()
	if want := fmt.Sprintf("runtime memory limit=%d\n", memlimit.Soft(hard)); !strings.Contains(out, want) {
		t.Fatalf("child in a %d-byte cgroup: want %q in\n%s", hard, want, out)
	}
	if !strings.Contains(out, "Go soft memory limit set below the cgroup's memory limit") {
		t.Fatalf("no log line for the limit in\n%s", out)
	}

	out = run("GOMEMLIMIT=100MiB")
	if want := fmt.Sprintf("runtime memory limit=%d\n", 100<<20); !strings.Contains(out, want) {
		t.Fatalf("GOMEMLIMIT=100MiB: want %q in\n%s", want, out)
	}
}
