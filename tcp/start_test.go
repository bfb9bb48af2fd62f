package tcp

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestStartServesWithoutRun: on the io_uring engine Start serves without a goroutine in Run,
// through a refusal and back (SetRefusing arms the new listener itself), and Close ends it; on
// the epoll engine it reports false and leaves the proxy to Run. Address plan: proxy on
// 127.0.0.1, endpoint on 127.0.0.3.
func TestStartServesWithoutRun(t *testing.T) {
	ep := serve(t, "127.0.0.3", echo)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Logger: testLogger(t)})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatalf("Listen: %v", err)
	}
	t.Cleanup(p.Shutdown)
	started, err := p.Start()
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	if uring := p.engine().Name() == EngineIOUring; started != uring {
		t.Fatalf("Start = %v on the %s engine", started, p.engine().Name())
	}
	if !started {
		return
	}
	kept := dial(t, p)
	roundTrip(t, kept, "started")
	for round := range 2 {
		if err := p.SetRefusing(true); err != nil {
			t.Fatalf("round %d: SetRefusing(true): %v", round, err)
		}
		if c, err := dialFrom(t, "127.0.0.1", p); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("round %d: connect while refusing: %v (conn %v), want ECONNREFUSED", round, err, c)
		}
		if err := p.SetRefusing(false); err != nil {
			t.Fatalf("round %d: SetRefusing(false): %v", round, err)
		}
		var c *net.TCPConn
		testenv.WaitFor(t, "the reopened listener to serve", func() bool {
			c, err = dialFrom(t, "127.0.0.1", p)
			return err == nil
		})
		roundTrip(t, c, "after")
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if c, err := dialFrom(t, "127.0.0.1", p); err == nil {
		t.Errorf("connect after Close worked (conn %v)", c)
	}
	roundTrip(t, kept, "still")
}
