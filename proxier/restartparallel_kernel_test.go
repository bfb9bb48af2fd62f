package proxier

// Address plan: none; one namespace "node", no address, no packet.

import (
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// TestForEachInNetnsRunsInTheCallersNamespace: the reopen's workers open their sockets in the
// namespace of the thread that called it, although Go starts their goroutines on threads of the
// process's namespace (an earlier parallel reopen opened them there: TestKernelReopenBeforeFirstSync
// failed). Each call records its thread's namespace; every one must be the caller's.
func TestForEachInNetnsRunsInTheCallersNamespace(t *testing.T) {
	node := netns.NewTestLab(t).MustAdd(t, "node")
	const n, workers = 256, 4
	var mu sync.Mutex
	seen := map[nsID]int{}
	var want nsID
	err := node.Do(func() error {
		var err error
		if want, err = threadNetns(); err != nil {
			return err
		}
		forEachInNetns(n, workers, func(int) {
			id, err := threadNetns()
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			seen[id]++
			mu.Unlock()
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(seen) != 1 || seen[want] != n {
		t.Errorf("calls by namespace %v, want all %d in the caller's %v", seen, n, want)
	}
	root, err := threadNetns()
	if err != nil {
		t.Fatal(err)
	}
	if root == want {
		t.Fatal("the test's namespace is the process's: it proves nothing")
	}
}

func threadNetns() (nsID, error) {
	var st unix.Stat_t
	if err := unix.Stat(threadNetnsPath(), &st); err != nil {
		return nsID{}, err
	}
	return nsID{dev: st.Dev, ino: st.Ino}, nil
}
