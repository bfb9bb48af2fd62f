package tcp

import (
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Address plan: the proxy on 127.0.0.1, the endpoint on 127.0.0.3 (kernel-chosen ports);
// loopback only.

// TestKeepAliveRequestAllocatesNothing guards the claim that an established connection moves a
// keep-alive request and its answer without allocating: a per-request allocation on either
// engine's data path (a closure, a boxed error, a deadline timer) costs GC work at every request.
// The client and the endpoint run in this process and read into fixed buffers, so the count
// through the proxy is compared with the same exchanges made directly. TestEveryTestOnIOUring runs
// it on the io_uring engine.
//
// Without the race detector only (make allocs; make test runs it): under it, sync.Pool drops a
// quarter of what is put back, so the pooled buffer of each request's read (splice.go) is
// allocated again where production reuses it.
func TestKeepAliveRequestAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool allocate: run without -race (make allocs)")
	}
	ep := serve(t, "127.0.0.3", echoFixed)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{})
	// The same through a proxy that records flows (Config.Flows): the request must not allocate
	// for the recorder either.
	rec := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Flows: &copyRecorder{}})
	const runs = 2000
	perRequest := func(addr netip.AddrPort) float64 {
		c, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(addr))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		req, resp := make([]byte, 64), make([]byte, 64)
		var failed error
		exchange := func() {
			if _, err := c.Write(req); err != nil && failed == nil {
				failed = err
			}
			if _, err := io.ReadFull(c, resp); err != nil && failed == nil {
				failed = err
			}
		}
		for range 100 { // steady state: the directions, buffers and pipes are set up
			exchange()
		}
		allocs := testing.AllocsPerRun(runs, exchange)
		if failed != nil {
			t.Fatalf("exchange with %s: %v", addr, failed)
		}
		return allocs
	}
	direct, proxied, recorded := perRequest(ep), perRequest(p.Addr()), perRequest(rec.Addr())
	if proxied > direct || recorded > direct {
		t.Errorf("%v allocations per keep-alive request through the proxy (%s engine), %v recording flows, %v directly; want no more",
			proxied, p.engine().Name(), recorded, direct)
	}
	t.Logf("%s engine: %v allocations per request through the proxy, %v recording flows, %v directly", p.engine().Name(), proxied, recorded, direct)
}

// TestKeepAliveRequestAllocatesNothingRecordingNewConnections (named so that make allocs runs it): a new connection through a proxy whose
// Config.Flows is set (a recorder that copies each event, as the hub does) allocates no more
// than through one without: its events live in pooled state, not on the heap per event or per
// connection. Without the race detector only, as above.
func TestKeepAliveRequestAllocatesNothingRecordingNewConnections(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool allocate: run without -race (make allocs)")
	}
	ep := serve(t, "127.0.0.3", echoFixed)
	plain := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{})
	rec := &copyRecorder{}
	recording := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Flows: rec})
	const runs = 500
	perConn := func(p *Proxy) float64 {
		req, resp := make([]byte, 64), make([]byte, 64)
		var failed error
		conn := func() {
			c, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(p.Addr()))
			if err != nil {
				failed = err
				return
			}
			defer c.Close()
			if _, err := c.Write(req); err != nil && failed == nil {
				failed = err
			}
			if _, err := io.ReadFull(c, resp); err != nil && failed == nil {
				failed = err
			}
		}
		for range 50 {
			conn()
		}
		allocs := testing.AllocsPerRun(runs, conn)
		if failed != nil {
			t.Fatalf("connection to %s: %v", p.Addr(), failed)
		}
		return allocs
	}
	// Alternated, so that what else the process allocates meanwhile weighs on both alike.
	var without, with float64
	for range 2 {
		without += perConn(plain) / 2
		with += perConn(recording) / 2
	}
	if with > without+0.5 {
		t.Errorf("%.2f allocations per connection recording flows, %.2f without (%s engine); want no more", with, without, plain.engine().Name())
	}
	if rec.n.Load() == 0 {
		t.Error("the recorder got no event")
	}
	t.Logf("%s engine: %.2f allocations per connection recording flows, %.2f without", plain.engine().Name(), with, without)
}

// copyRecorder copies each event and drops it.
type copyRecorder struct {
	mu   sync.Mutex
	last flow.Event
	n    atomic.Int64
}

func (r *copyRecorder) Record(e *flow.Event) {
	r.mu.Lock()
	r.last = *e
	r.mu.Unlock()
	r.n.Add(1)
}

// echoFixed echoes through a fixed buffer until EOF: io.Copy would take the splice path of the
// runtime, whose pipes come from a pool.
func echoFixed(c *net.TCPConn) {
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			c.CloseWrite()
			return
		}
	}
}
