package tcp

import (
	"io"
	"net"
	"net/netip"
	"testing"
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
	direct, proxied := perRequest(ep), perRequest(p.Addr())
	if proxied > direct {
		t.Errorf("%v allocations per keep-alive request through the proxy (%s engine), %v directly; want no more", proxied, p.engine().Name(), direct)
	}
	t.Logf("%s engine: %v allocations per request through the proxy, %v directly", p.engine().Name(), proxied, direct)
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
