package tcp

import (
	"bytes"
	"errors"
	"fmt"
	"golang.org/x/sys/unix"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

func TestRoundTrip(t *testing.T) {
	bulk := strings.Repeat("0123456789abcdef", 1<<19) // 8 MiB
	for _, m := range modes {
		for _, tt := range []struct {
			name, payload string
		}{
			{"small", "hello"},
			{"bulk_8MiB", bulk},
		} {
			t.Run(m.name+"/"+tt.name, func(t *testing.T) {
				ep := serve(t, "127.0.0.3", echo)
				closed := make(closedCh, 1)
				p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter, OnEnd: closed.onClose})
				c := dial(t, p)
				var got []byte
				done := make(chan error, 1)
				go func() {
					var err error
					got, err = io.ReadAll(c)
					done <- err
				}()
				if _, err := c.Write([]byte(tt.payload)); err != nil {
					t.Fatalf("write: %v", err)
				}
				c.CloseWrite()
				if err := <-done; err != nil {
					t.Fatalf("read: %v", err)
				}
				if !bytes.Equal(got, []byte(tt.payload)) {
					t.Fatalf("echoed %d bytes, want %d identical bytes", len(got), len(tt.payload))
				}
				ci := closed.next(t)
				n := uint64(len(tt.payload))
				want := flow.Info{Client: ci.Client, Endpoint: ep, BytesToEndpoint: n, BytesToClient: n, DialAttempts: 1, End: flow.ClientClosed}
				if got := (flow.Info{Client: ci.Client, Endpoint: ci.Endpoint, BytesToEndpoint: ci.BytesToEndpoint, BytesToClient: ci.BytesToClient, DialAttempts: ci.DialAttempts, End: ci.End, Err: ci.Err}); got != want {
					t.Errorf("OnEnd (-want +got):\n-%+v\n+%+v", want, got)
				}
				if ci.Client.Addr() != netip.MustParseAddr("127.0.0.1") {
					t.Errorf("client address %s, want 127.0.0.1:*", ci.Client)
				}
				st := p.Stats()
				wantSt := flow.Stats{Active: 0, Total: 1, BytesToEndpoint: n, BytesToClient: n, DialAttempts: 1}
				wantSt.Ended[flow.ClientClosed] = 1
				if st != wantSt {
					t.Errorf("Stats (-want +got):\n-%+v\n+%+v", wantSt, st)
				}
			})
		}
	}
}

func TestManyConcurrentClients(t *testing.T) {
	const clients = 200
	ep1, ep2 := serve(t, "127.0.0.3", echo), serve(t, "127.0.0.4", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep1, ep2}}, Config{ParkAfter: time.Millisecond})
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("tcp4", p.Addr().String())
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			for j := range 3 {
				msg := fmt.Sprintf("client %d message %d", i, j)
				c.Write([]byte(msg))
				buf := make([]byte, len(msg))
				if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
					errs <- fmt.Errorf("client %d: got %q, %v; want %q", i, buf, err, msg)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	testenv.WaitFor(t, "all connections to end", func() bool { return p.Stats().Active == 0 })
	if got := p.Stats().Total; got != clients {
		t.Errorf("Total = %d, want %d", got, clients)
	}
}

func TestHalfClose(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name+"/client_shutdown_write_still_gets_whole_response", func(t *testing.T) {
			const response = 3 << 20
			// The endpoint reads the request to EOF, then answers with 3 MiB and closes.
			ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
				req, _ := io.ReadAll(c)
				c.Write(bytes.Repeat(req[:1], response))
			})
			closed := make(closedCh, 1)
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter, OnEnd: closed.onClose})
			c := dial(t, p)
			c.Write([]byte("x-request"))
			if err := c.CloseWrite(); err != nil {
				t.Fatalf("shutdown(SHUT_WR): %v", err)
			}
			got, err := io.ReadAll(c)
			if err != nil || len(got) != response {
				t.Fatalf("response after half-close: %d bytes, %v; want %d bytes and EOF", len(got), err, response)
			}
			if ci := closed.next(t); ci.End != flow.ClientClosed || ci.Err != nil {
				t.Errorf("end = %v, %v; want %v, nil", ci.End, ci.Err, flow.ClientClosed)
			}
		})
		t.Run(m.name+"/endpoint_fin_first_client_keeps_sending", func(t *testing.T) {
			received := make(chan string, 1)
			ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
				c.Write([]byte("banner"))
				c.CloseWrite()
				rest, _ := io.ReadAll(c)
				received <- string(rest)
			})
			closed := make(closedCh, 1)
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter, OnEnd: closed.onClose})
			c := dial(t, p)
			got, err := io.ReadAll(c)
			if err != nil || string(got) != "banner" {
				t.Fatalf("read until endpoint FIN: %q, %v; want %q, EOF", got, err, "banner")
			}
			if _, err := c.Write([]byte("after-fin")); err != nil {
				t.Fatalf("write after endpoint FIN: %v", err)
			}
			c.CloseWrite()
			if got := <-received; got != "after-fin" {
				t.Errorf("endpoint received (-want +got):\n-%q\n+%q", "after-fin", got)
			}
			if ci := closed.next(t); ci.End != flow.EndpointClosed {
				t.Errorf("end = %v, want %v", ci.End, flow.EndpointClosed)
			}
		})
	}
}

func isReset(err error) bool { return errors.Is(err, syscall.ECONNRESET) }

func TestResetPropagation(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name+"/endpoint_reset_resets_client", func(t *testing.T) {
			ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
				io.ReadFull(c, make([]byte, 4))
				c.SetLinger(0)
			}) // handler returns: Close with linger 0 sends RST
			closed := make(closedCh, 1)
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter, OnEnd: closed.onClose})
			c := dial(t, p)
			c.Write([]byte("ping"))
			_, err := io.ReadAll(c)
			if !isReset(err) {
				t.Fatalf("client read after endpoint RST: %v, want ECONNRESET", err)
			}
			ci := closed.next(t)
			if ci.End != flow.EndpointReset || ci.Err == nil || !strings.Contains(ci.Err.Error(), "endpoint->client: read") {
				t.Errorf("end = %v, err = %v; want %v and an error naming endpoint->client: read", ci.End, ci.Err, flow.EndpointReset)
			}
		})
		t.Run(m.name+"/client_reset_resets_endpoint", func(t *testing.T) {
			got := make(chan error, 1)
			ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
				c.SetDeadline(time.Now().Add(20 * time.Second))
				c.Write([]byte("hi"))
				_, err := io.ReadAll(c)
				got <- err
			})
			closed := make(closedCh, 1)
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter, OnEnd: closed.onClose})
			c := dial(t, p)
			io.ReadFull(c, make([]byte, 2))
			c.SetLinger(0)
			c.Close()
			if err := <-got; !isReset(err) {
				t.Fatalf("endpoint read after client RST: %v, want ECONNRESET", err)
			}
			if ci := closed.next(t); ci.End != flow.ClientReset {
				t.Errorf("end = %v, want %v", ci.End, flow.ClientReset)
			}
		})
	}
}

func TestDialFailover(t *testing.T) {
	t.Run("refused_endpoint_falls_over_to_next_with_affinity_reset", func(t *testing.T) {
		good := serve(t, "127.0.0.3", echo)
		picker := &fakePicker{eps: []netip.AddrPort{refusedPort(t), good}}
		closed := make(closedCh, 1)
		p := startProxy(t, picker, Config{OnEnd: closed.onClose})
		c := dial(t, p)
		roundTrip(t, c, "after failover")
		c.Close()
		client := netip.MustParseAddr("127.0.0.1")
		want := []pick{{client, false}, {client, true}}
		if got := picker.picks(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("picker calls (-want +got):\n-%v\n+%v", want, got)
		}
		if ci := closed.next(t); ci.DialAttempts != 2 || ci.Endpoint != good {
			t.Errorf("dial attempts %d to %s, want 2 ending at %s", ci.DialAttempts, ci.Endpoint, good)
		}
		st := p.Stats()
		if st.DialAttempts != 2 || st.DialFailures != 1 || st.DialRetries != 1 {
			t.Errorf("dial stats %+v, want 2 attempts, 1 failure, 1 retry", st)
		}
	})
	t.Run("unanswered_endpoint_times_out_to_next", func(t *testing.T) {
		// The only test of a dial that does not complete inside connect (on loopback every other
		// one does): it must wait in the poller and give up at the attempt's timeout.
		good := serve(t, "127.0.0.3", echo)
		picker := &fakePicker{eps: []netip.AddrPort{unansweredPort(t), good}}
		closed := make(closedCh, 1)
		const first = 200 * time.Millisecond
		p := startProxy(t, picker, Config{DialTimeouts: []time.Duration{first, 5 * time.Second}, OnEnd: closed.onClose})
		start := time.Now()
		c := dial(t, p)
		roundTrip(t, c, "after a timeout")
		if took := time.Since(start); took < first {
			t.Errorf("round trip after %v, want at least the first attempt's %v", took, first)
		}
		c.Close()
		if ci := closed.next(t); ci.DialAttempts != 2 || ci.Endpoint != good {
			t.Errorf("dial attempts %d to %s, want 2 ending at %s", ci.DialAttempts, ci.Endpoint, good)
		}
		if st := p.Stats(); st.DialFailures != 1 || st.DialRetries != 1 {
			t.Errorf("dial stats %+v, want 1 failure and 1 retry", st)
		}
	})
	t.Run("every_attempt_refused_resets_client_after_ladder", func(t *testing.T) {
		picker := &fakePicker{eps: []netip.AddrPort{refusedPort(t)}}
		closed := make(closedCh, 1)
		ladder := []time.Duration{100 * time.Millisecond, 100 * time.Millisecond, 100 * time.Millisecond}
		p := startProxy(t, picker, Config{DialTimeouts: ladder, OnEnd: closed.onClose})
		if err := dialExpectReset(t, p); !isReset(err) {
			t.Fatalf("client: %v, want ECONNRESET", err)
		}
		if ci := closed.next(t); ci.End != flow.DialFailed || ci.DialAttempts != len(ladder) {
			t.Errorf("end %v after %d attempts, want %v after %d", ci.End, ci.DialAttempts, flow.DialFailed, len(ladder))
		}
	})
}

func TestNoEndpointsResetsClient(t *testing.T) {
	closed := make(closedCh, 1)
	p := startProxy(t, &fakePicker{}, Config{OnEnd: closed.onClose})
	if err := dialExpectReset(t, p); !isReset(err) {
		t.Fatalf("client: %v, want ECONNRESET", err)
	}
	if ci := closed.next(t); ci.End != flow.NoEndpoints {
		t.Errorf("end = %v, want %v", ci.End, flow.NoEndpoints)
	}
	if st := p.Stats(); st.NoEndpoint != 1 || st.DialAttempts != 0 {
		t.Errorf("stats %+v, want NoEndpoint 1 and no dial", st)
	}
}

func TestCloseKeepsEstablishedConnections(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			ep := serve(t, "127.0.0.3", echo)
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: m.parkAfter})
			c := dial(t, p)
			roundTrip(t, c, "before close")
			if err := p.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
			if nc, err := net.Dial("tcp4", p.Addr().String()); err == nil {
				nc.Close()
				t.Errorf("new connection accepted after Close")
			}
			roundTrip(t, c, "after close")
			if n := len(p.Live()); n != 1 {
				t.Errorf("live connections after Close = %d, want 1", n)
			}
		})
	}
}

func TestDropEndpointResetsOnlyItsConnections(t *testing.T) {
	ep1, ep2 := serve(t, "127.0.0.3", echo), serve(t, "127.0.0.4", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep1, ep2}}, Config{})
	c1, c2 := dial(t, p), dial(t, p)
	roundTrip(t, c1, "one")
	roundTrip(t, c2, "two")
	// The two connections' goroutines race to the picker: name them by the endpoint they got.
	for _, ci := range p.Live() {
		if ci.Endpoint == ep1 && ci.Client.String() != c1.LocalAddr().String() {
			c1, c2 = c2, c1
		}
	}
	if n := p.DropEndpoint(ep1); n != 1 {
		t.Fatalf("DropEndpoint(%s) = %d, want 1", ep1, n)
	}
	if _, err := c1.Read(make([]byte, 1)); !isReset(err) {
		t.Errorf("drained client read: %v, want ECONNRESET", err)
	}
	roundTrip(t, c2, "still here")
	// The client->endpoint counter is bumped after the write, which can be after the echo came
	// back: wait for it. "one" and "two" have one length, so the count does not depend on the swap.
	testenv.WaitFor(t, "the survivor's bytes in", func() bool {
		conns := p.Live()
		return len(conns) == 1 && conns[0].BytesToEndpoint == uint64(len("twostill here"))
	})
	conns := p.Live()
	if len(conns) != 1 || conns[0].Endpoint != ep2 || conns[0].Client.String() != c2.LocalAddr().String() ||
		conns[0].BytesToEndpoint != uint64(len("twostill here")) {
		t.Errorf("Live() = %+v, want only %s's connection to %s with %d bytes in", conns, c2.LocalAddr(), ep2, len("twostill here"))
	}
}

func TestIdleTimeout(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
			ep := serve(t, "127.0.0.3", echo)
			closed := make(closedCh, 1)
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}},
				Config{IdleTimeout: 10 * time.Second, Clock: clk, ParkAfter: m.parkAfter, OnEnd: closed.onClose})
			c := dial(t, p)
			roundTrip(t, c, "active")
			testenv.WaitFor(t, "the idle sweeper to start", clk.HasWaiters)
			clk.Step(5 * time.Second)
			roundTrip(t, c, "still active") // moves the last-activity mark to t+5s
			clk.Step(5 * time.Second)       // 5s idle: kept
			roundTrip(t, c, "")
			if n := len(p.Live()); n != 1 {
				t.Fatalf("connections after 5s idle = %d, want 1", n)
			}
			clk.Step(11 * time.Second)
			if n, err := c.Read(make([]byte, 1)); err != io.EOF {
				t.Fatalf("client read after idle timeout: %d, %v; want EOF", n, err)
			}
			if ci := closed.next(t); ci.End != flow.IdleTimeout {
				t.Errorf("end = %v, want %v", ci.End, flow.IdleTimeout)
			}
		})
	}
}

// TestIdleConnectionsNeedNoGoroutine checks the memory design: idle connections park and keep
// working when traffic resumes.
func TestIdleConnectionsNeedNoGoroutine(t *testing.T) {
	const conns = 50
	ep := serve(t, "127.0.0.3", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: time.Millisecond})
	cs := make([]*net.TCPConn, conns)
	for i := range cs {
		cs[i] = dial(t, p)
		roundTrip(t, cs[i], "warm")
	}
	testenv.WaitFor(t, "every direction to park", func() bool { return directionGoroutines() == 0 })
	if got := len(p.Live()); got != conns {
		t.Fatalf("live connections = %d, want %d", got, conns)
	}
	for i, c := range cs {
		roundTrip(t, c, fmt.Sprint("wake ", i))
	}
}

// directionGoroutines counts goroutines moving data for a connection.
func directionGoroutines() int {
	buf := make([]byte, 1<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "tcp.(*direction).run(")
}

func TestNoGoroutineLeakAfterShutdown(t *testing.T) {
	before := runtime.NumGoroutine()
	ep := serve(t, "127.0.0.3", echo)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ParkAfter: time.Millisecond, IdleTimeout: time.Hour, Logger: testLogger(t)})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(t.Context()) }()
	var cs []*net.TCPConn
	for i := range 20 {
		c := dial(t, p)
		roundTrip(t, c, fmt.Sprint(i))
		cs = append(cs, c)
	}
	cs[0].CloseWrite() // one half-closed
	p.Shutdown()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	for _, c := range cs {
		c.Close()
	}
	testenv.WaitFor(t, "goroutines to return to the baseline (+1 for the endpoint's listener)", func() bool {
		return runtime.NumGoroutine() <= before+1
	})
	if st := p.Stats(); st.Active != 0 {
		t.Errorf("Active after Shutdown = %d, want 0", st.Active)
	}
}

// TestIdleServicePortHoldsOneDescriptor: a listening proxy nobody uses costs its listener only, so
// 10,000 service ports fit under a 20,000-descriptor limit.
func TestIdleServicePortHoldsOneDescriptor(t *testing.T) {
	// Descriptors are compared as sets (number and target), not counted: earlier tests leave
	// pipes in Go's splice pipe pool that the garbage collector closes at any moment.
	open := func() map[string]string {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		fds := map[string]string{}
		for _, e := range ents {
			if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil {
				fds[e.Name()] = target
			}
		}
		return fds
	}
	before := open()
	var proxies []*Proxy
	for range 20 {
		p := New(testName, &fakePicker{}, Config{})
		if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
			t.Fatal(err)
		}
		go p.Run(t.Context())
		proxies = append(proxies, p)
	}
	defer func() {
		for _, p := range proxies {
			p.Shutdown()
		}
	}()
	var added []string
	for fd, target := range open() {
		if before[fd] != target {
			added = append(added, fd+" -> "+target)
		}
	}
	sockets := 0
	for _, a := range added {
		if strings.Contains(a, "-> socket:") {
			sockets++
		}
	}
	if len(added) != 20 || sockets != 20 {
		t.Errorf("20 idle proxies opened %d descriptors (%d sockets), want 20 listening sockets: %v", len(added), sockets, added)
	}
}

// TestKeepAliveOnBothLegs: the client leg inherits keepalive and TCP_NODELAY from the listening
// socket, the endpoint leg gets them from the dialer.
func TestKeepAliveOnBothLegs(t *testing.T) {
	ep := serve(t, "127.0.0.1", echo)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{KeepAlive: 7 * time.Second})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	go p.Run(t.Context())
	defer p.Shutdown()
	c, err := net.Dial("tcp4", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	conns := p.snapshot()
	if len(conns) != 1 {
		t.Fatalf("%d live connections, want 1", len(conns))
	}
	client, endpoint := legFDs(conns[0])
	for name, fd := range map[string]int{"client": client, "endpoint": endpoint} {
		var on, idle, nodelay int
		var gerr error
		if on, gerr = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE); gerr == nil {
			idle, gerr = unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE)
		}
		if gerr == nil {
			nodelay, gerr = unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY)
		}
		if gerr != nil || on != 1 || idle != 7 || nodelay != 1 {
			t.Errorf("%s leg: SO_KEEPALIVE=%d TCP_KEEPIDLE=%d TCP_NODELAY=%d (%v), want 1, 7 and 1", name, on, idle, nodelay, gerr)
		}
	}
}

// TestIPv6 proxies between IPv6 loopback addresses (the sockets are built by hand, not by package
// net) and reports the client's IPv6 address.
func TestIPv6(t *testing.T) {
	ln, err := net.ListenTCP("tcp6", &net.TCPAddr{IP: net.IPv6loopback})
	if err != nil {
		testenv.Unavailable(t, "no IPv6 loopback here: %v", err)
	}
	ln.Close()
	ep := serve(t, "::1", echo)
	closed := make(closedCh, 1)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Logger: testLogger(t), OnEnd: closed.onClose})
	if err := p.Listen(netip.MustParseAddrPort("[::1]:0")); err != nil {
		t.Fatalf("Listen: %v", err)
	}
	go p.Run(t.Context())
	defer p.Shutdown()
	if !p.Addr().Addr().Is6() || p.Addr().Port() == 0 {
		t.Fatalf("bound to %v, want [::1] and a port", p.Addr())
	}
	c, err := net.DialTCP("tcp6", nil, net.TCPAddrFromAddrPort(p.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	roundTrip(t, c, "hello over IPv6")
	client := c.LocalAddr().(*net.TCPAddr).AddrPort()
	c.Close()
	ci := closed.next(t)
	if ci.Client != client || ci.Endpoint != ep {
		t.Errorf("flow.Info client %v endpoint %v, want %v and %v", ci.Client, ci.Endpoint, client, ep)
	}
}
