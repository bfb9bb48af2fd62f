package daemon

// Address plan: node addresses from 192.0.2.0/24 (TEST-NET-1) on the Node object; the host's
// own interfaces only decide the families the Node does not name, which the test ignores.

import (
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

func nodeWith(addrs ...string) *v1.Node {
	n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}
	for _, a := range addrs {
		n.Status.Addresses = append(n.Status.Addresses, v1.NodeAddress{Type: v1.NodeInternalIP, Address: a})
	}
	return n
}

// TestNodeIPsFollowTheNode: the start guesses the node IPs from the interfaces; the Node's
// addresses replace them when read, and again whenever they change, each time with a sync.
func TestNodeIPsFollowTheNode(t *testing.T) {
	log, _ := logtest.NewNullLogger()
	var set []netip.Addr
	syncs := 0
	n := &nodeIPs{bind: netip.IPv4Unspecified(), log: logrus.NewEntry(log), sync: func() { syncs++ },
		set: func(ips map[portal.Family]netip.Addr) { set = append(set, ips[portal.IPv4]) },
		cur: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("192.0.2.2")}}

	steps := []struct {
		name      string
		node      *v1.Node
		wantSet   []string
		wantSyncs int
	}{
		{"no Node (not found, or the API unreachable): the guess stays", nil, nil, 0},
		{"the Node's InternalIP replaces the interfaces' guess", nodeWith("192.0.2.10"), []string{"192.0.2.10"}, 1},
		{"the same addresses again: nothing to do", nodeWith("192.0.2.10"), []string{"192.0.2.10"}, 1},
		{"a changed address is repaired", nodeWith("192.0.2.11"), []string{"192.0.2.10", "192.0.2.11"}, 2},
	}
	for _, st := range steps {
		n.update(st.node)
		var got []string
		for _, a := range set {
			got = append(got, a.String())
		}
		if len(got) != len(st.wantSet) || syncs != st.wantSyncs {
			t.Fatalf("%s: set %v with %d syncs, want %v with %d", st.name, got, syncs, st.wantSet, st.wantSyncs)
		}
		for i := range got {
			if got[i] != st.wantSet[i] {
				t.Fatalf("%s: set %v, want %v", st.name, got, st.wantSet)
			}
		}
	}

	t.Run("bind mode has no HOST rules: nothing is set", func(t *testing.T) {
		b := &nodeIPs{bind: netip.IPv4Unspecified(), log: logrus.NewEntry(log), sync: func() { t.Fatal("sync asked") }}
		b.update(nodeWith("192.0.2.10"))
	})
}

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
