package tcp

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan: proxy on 127.0.0.1:0 (one SO_REUSEPORT group), endpoint on 127.0.0.3, clients
// from 127.0.0.1.

// listeners is how many sockets the proxy listens on (0 while refusing).
func (p *Proxy) listeners() int {
	p.lnMu.Lock()
	defer p.lnMu.Unlock()
	if p.ln == nil {
		return 0
	}
	return 1 + len(p.extra)
}

// startQueued listens, lets queued clients complete their handshakes in the backlog before the
// accept loop runs (so it finds them waiting, as on a busy port), then runs the proxy.
func startQueued(t *testing.T, cfg Config, queued int) *Proxy {
	t.Helper()
	ep := serve(t, "127.0.0.3", echo)
	cfg.Logger = testLogger(t)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, cfg)
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatalf("Listen: %v", err)
	}
	var early []*net.TCPConn
	for range queued {
		early = append(early, dial(t, p))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		p.Shutdown()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	for _, c := range early {
		roundTrip(t, c, "queued")
	}
	return p
}

// burst serves n concurrent clients, each with one round trip.
func burst(t *testing.T, p *Proxy, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := dialFrom(t, "127.0.0.1", p)
			if err != nil {
				errs <- err
				return
			}
			msg := []byte("burst")
			if _, err := c.Write(msg); err != nil {
				errs <- err
				return
			}
			buf := make([]byte, len(msg))
			if _, err := c.Read(buf); err != nil || string(buf) != "burst" {
				errs <- errors.Join(err, errors.New("echo mismatch: "+string(buf)))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("client of the burst: %v", err)
	}
}

func TestSpreadOverReusePortListeners(t *testing.T) {
	for _, tt := range []struct {
		name          string
		acceptLoops   int
		queued        int
		wantListeners int
	}{
		{"busy port opens the extra listeners", 3, 2 * spreadAfter, 3},
		{"default stays on one listener", 0, 2 * spreadAfter, 1},
		{"a port whose connections never queue stays on one listener", 3, 0, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := startQueued(t, Config{AcceptLoops: tt.acceptLoops}, tt.queued)
			if tt.wantListeners > 1 {
				testenv.WaitFor(t, "the extra listeners", func() bool { return p.listeners() == tt.wantListeners })
			}
			for range 3 { // one at a time: each accept waits, no queue
				roundTrip(t, dial(t, p), "sequential")
			}
			if got := p.listeners(); got != tt.wantListeners {
				t.Errorf("listening sockets: %d, want %d", got, tt.wantListeners)
			}
			burst(t, p, 64) // served through whichever sockets there are
			if tt.acceptLoops <= 1 && p.listeners() != 1 {
				t.Errorf("listening sockets after a burst: %d, want 1 (AcceptLoops %d)", p.listeners(), tt.acceptLoops)
			}
			if got, want := p.Stats().Total, uint64(tt.queued+3+64); got != want {
				t.Errorf("Stats.Total %d, want %d: every connection served once", got, want)
			}
		})
	}
}

// TestSpreadRefusingClosesTheWholeGroup: SetRefusing(true) must close the extra listeners too,
// or the kernel would keep accepting on them; SetRefusing(false) listens again, and a new busy
// spell spreads again. Close leaves nothing listening either.
func TestSpreadRefusingClosesTheWholeGroup(t *testing.T) {
	p := startQueued(t, Config{AcceptLoops: 2}, 2*spreadAfter)
	testenv.WaitFor(t, "the extra listener", func() bool { return p.listeners() == 2 })

	if err := p.SetRefusing(true); err != nil {
		t.Fatalf("SetRefusing(true): %v", err)
	}
	for i := range 16 { // several source ports: the group's hash would pick each socket
		if c, err := dialFrom(t, "127.0.0.1", p); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("connect %d while refusing: %v (conn %v), want ECONNREFUSED", i, err, c)
		}
	}
	if err := p.SetRefusing(false); err != nil {
		t.Fatalf("SetRefusing(false): %v", err)
	}
	if got := p.listeners(); got != 1 {
		t.Errorf("listening sockets after refusing off: %d, want 1 until the port is busy again", got)
	}
	burst(t, p, 32)

	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for i := range 16 {
		if c, err := dialFrom(t, "127.0.0.1", p); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("connect %d after Close: %v (conn %v), want ECONNREFUSED", i, err, c)
		}
	}
}
