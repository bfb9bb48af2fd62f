package daemon

import (
	"context"
	"errors"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// fakeKernelPorts is a proxier.KernelFlowLookup whose port count the test sets.
type fakeKernelPorts struct {
	ports   atomic.Int64
	changed chan struct{}
}

func (f *fakeKernelPorts) Lookup(flow.Protocol, netip.AddrPort) flow.Recorder { return nil }
func (f *fakeKernelPorts) Ports() int                                         { return int(f.ports.Load()) }
func (f *fakeKernelPorts) Changed() <-chan struct{}                           { return f.changed }
func (f *fakeKernelPorts) set(n int64) {
	f.ports.Store(n)
	f.changed <- struct{}{}
}

// TestKernelFlowsWatchOnlyWhileKernelPorts: the conntrack watcher runs while some port is on the
// kernel path and stops when none is; one that fails is started again only at the next change,
// not in a loop.
func TestKernelFlowsWatchOnlyWhileKernelPorts(t *testing.T) {
	look := &fakeKernelPorts{changed: make(chan struct{})}
	var mu sync.Mutex
	starts, running := 0, 0
	fail := false
	watch := func(ctx context.Context) error {
		mu.Lock()
		starts++
		f := fail
		if !f {
			running++
		}
		mu.Unlock()
		if f {
			return errors.New("ctnetlink: operation not permitted")
		}
		<-ctx.Done()
		mu.Lock()
		running--
		mu.Unlock()
		return nil
	}
	state := func() (int, int) { mu.Lock(); defer mu.Unlock(); return starts, running }
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { kernelFlowsLoop(look, watch, logrus.New())(ctx); close(done) }()

	look.set(1)
	testenv.WaitFor(t, "a watcher once a port is on the kernel path", func() bool { s, r := state(); return s == 1 && r == 1 })
	look.set(2) // more ports: the same watcher
	look.set(0)
	testenv.WaitFor(t, "no watcher once none is", func() bool { s, r := state(); return s == 1 && r == 0 })

	mu.Lock()
	fail = true
	mu.Unlock()
	look.set(1)
	testenv.WaitFor(t, "the failing watcher's start", func() bool { s, _ := state(); return s == 2 })
	// Another change is what starts it again: send one and see exactly one more start.
	look.changed <- struct{}{} // the loop is back waiting: the failure was seen
	testenv.WaitFor(t, "one start per change after a failure", func() bool { s, _ := state(); return s == 3 })
	if s, _ := state(); s != 3 {
		t.Errorf("%d starts, want 3: a failed watcher was restarted without a change", s)
	}
	cancel()
	<-done
}
