package tcp

// Address plan: see helpers_test.go (proxy on 127.0.0.1, endpoints on 127.0.0.3 and 127.0.0.4).

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestDrainEndpoint: at an endpoint's drain deadline its connections are sent FIN both ways; a
// client that closes on EOF ends cleanly, one that does not is reset after the grace, and the
// connections of other endpoints go on untouched.
func TestDrainEndpoint(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			t.Run("fin_then_clean_close", func(t *testing.T) {
				backendEOF := make(chan struct{}, 1)
				ep1 := serve(t, "127.0.0.3", func(c *net.TCPConn) {
					echo(c)
					backendEOF <- struct{}{}
				})
				ep2 := serve(t, "127.0.0.4", echo)
				clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
				ended := make(closedCh, 2)
				p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep1, ep2}}, Config{ParkAfter: m.parkAfter, Clock: clk, OnEnd: ended.onClose})
				c1, c2 := dial(t, p), dial(t, p)
				roundTrip(t, c1, "one")
				roundTrip(t, c2, "two")
				for _, ci := range p.Live() {
					if ci.Endpoint == ep1 && ci.Client.String() != c1.LocalAddr().String() {
						c1, c2 = c2, c1
					}
				}
				if n := p.DrainEndpoint(ep1, time.Minute); n != 1 {
					t.Fatalf("DrainEndpoint(%s) = %d, want 1", ep1, n)
				}
				if _, err := c1.Read(make([]byte, 1)); err != io.EOF {
					t.Fatalf("drained client read: %v, want EOF (a FIN, not a reset)", err)
				}
				select {
				case <-backendEOF:
				case <-time.After(10 * time.Second):
					t.Fatal("the endpoint never read EOF")
				}
				c1.Close()
				if info := ended.next(t); info.End != flow.DrainTimeout || info.Endpoint != ep1 {
					t.Errorf("ended flow = %+v, want drain-timeout on %s", info, ep1)
				}
				roundTrip(t, c2, "still here")
				if n := p.DrainEndpoint(ep1, time.Minute); n != 0 {
					t.Errorf("second DrainEndpoint(%s) = %d, want 0", ep1, n)
				}
			})
			t.Run("reset_after_grace", func(t *testing.T) {
				testEnds := make(chan struct{})
				ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
					io.Copy(c, c) // reads to EOF, then keeps its side open until the test ends
					<-testEnds
				})
				t.Cleanup(func() { close(testEnds) }) // runs before serve's cleanup waits for the handler
				clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
				ended := make(closedCh, 1)
				p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter, Clock: clk, OnEnd: ended.onClose})
				c := dial(t, p)
				roundTrip(t, c, "hello")
				if n := p.DrainEndpoint(ep, 2*time.Second); n != 1 {
					t.Fatalf("DrainEndpoint = %d, want 1", n)
				}
				if _, err := c.Read(make([]byte, 1)); err != io.EOF {
					t.Fatalf("client read after the deadline: %v, want EOF", err)
				}
				if n := len(p.Live()); n != 1 {
					t.Fatalf("live connections before the grace = %d, want 1 (FIN sent, nobody closed)", n)
				}
				testenv.WaitFor(t, "the grace timer", func() bool { return clk.HasWaiters() })
				clk.Step(2 * time.Second)
				if info := ended.next(t); info.End != flow.DrainTimeout {
					t.Errorf("ended flow = %+v, want drain-timeout", info)
				}
				_, err := c.Write([]byte("x"))
				if err == nil {
					_, err = c.Read(make([]byte, 1))
				}
				// The client got FIN first (CLOSE_WAIT), where the kernel reports a reset as EPIPE;
				// without the reset, a write in CLOSE_WAIT would succeed.
				if !isReset(err) && !errors.Is(err, syscall.EPIPE) {
					t.Errorf("client after the grace: %v, want ECONNRESET or EPIPE (reset)", err)
				}
			})
		})
	}
}
