package daemon

import (
	"os"
	"strconv"
	"strings"
	"testing"

	logtest "github.com/sirupsen/logrus/hooks/test"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// threadNices reads every thread's nice value from /proc/self/task/*/stat (field 19), the way
// ps and top see it.
func threadNices(t *testing.T) map[int]int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]int{}
	for _, e := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + e.Name() + "/stat")
		if err != nil {
			continue // the thread ended
		}
		fields := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
		nice, err := strconv.Atoi(fields[16]) // field 19 counted from pid
		if err != nil {
			t.Fatal(err)
		}
		tid, _ := strconv.Atoi(e.Name())
		out[tid] = nice
	}
	return out
}

// TestStartupPriority: a successor's start runs every thread at lowered priority (the running
// predecessor's data path comes first), and ready gives each back the nice value it had. Needs
// CAP_SYS_RESOURCE (or CAP_SYS_NICE) to come back; without, nothing is lowered.
func TestStartupPriority(t *testing.T) {
	orig := threadNices(t)[os.Getpid()]
	log, _ := logtest.NewNullLogger()
	restore := lowerPriority(log)
	t.Cleanup(restore)
	if err := allowNice(orig); err != nil && !hasCapSysNice() {
		testenv.Unavailable(t, "cannot raise RLIMIT_NICE to come back (%v)", err)
	}
	want := min(orig+startupNice, 19)
	for tid, nice := range threadNices(t) {
		if nice != want {
			t.Errorf("thread %d at nice %d during the start, want %d", tid, nice, want)
		}
	}
	restore()
	for tid, nice := range threadNices(t) {
		if nice != orig {
			t.Errorf("thread %d at nice %d once ready, want %d again", tid, nice, orig)
		}
	}
}
