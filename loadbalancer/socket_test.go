package loadbalancer_test

// Address plan: TCP/UDP echo endpoints and the proxy listen on 127.0.0.1, kernel-chosen ports;
// clients dial the proxy from 127.0.0.1. 127.0.0.5 holds a listener whose full accept queue
// drops SYNs (a black hole: dials to it time out).

import (
	"context"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

var web = service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}

// proxyFor runs a real TCP proxy socket for the balancer's service port.
func proxyFor(t *testing.T, s *loadbalancer.Service) string {
	t.Helper()
	return runProxy(t, s, tcp.Config{}).Addr().String()
}

func runProxy(t *testing.T, s *loadbalancer.Service, cfg tcp.Config) *tcp.Proxy {
	t.Helper()
	p := tcp.New(web, s, cfg)
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		p.Close()
		<-done
	})
	return p
}

// roundTrip opens a connection through the proxy and checks one echo, so the dial is done.
func roundTrip(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("echo through the proxy: %v", err)
	}
	return c
}

func activeTotal(s *loadbalancer.Service) int64 {
	var n int64
	for _, st := range s.EndpointStates() {
		n += st.Active
	}
	return n
}

// TestLeastConnectionsSpreadsLongConnections opens long connections through a real proxy with
// two short ones (opened, echoed, closed) between each, over three endpoints. Round robin's
// counter then lands every long connection on one endpoint; least-connections sees the live
// connections the proxy reports and spreads them evenly.
func TestLeastConnectionsSpreadsLongConnections(t *testing.T) {
	tests := []struct {
		algorithm service.Algorithm
		want      []int64 // long connections per endpoint, sorted
	}{
		{service.RoundRobin, []int64{0, 0, 9}},
		{service.LeastConnections, []int64{3, 3, 3}},
	}
	for _, tc := range tests {
		t.Run(string(tc.algorithm), func(t *testing.T) {
			lb := loadbalancer.New(clock.RealClock{})
			lb.SetBalancing(web, service.Balancing{Algorithm: tc.algorithm})
			lb.SetEndpoints(web, []netip.AddrPort{testenv.EchoTCP(t), testenv.EchoTCP(t), testenv.EchoTCP(t)})
			s := lb.Lookup(web)
			addr := proxyFor(t, s)
			for i := range 9 {
				long := roundTrip(t, addr)
				t.Cleanup(func() { long.Close() })
				for range 2 {
					roundTrip(t, addr).Close()
				}
				want := int64(i + 1)
				testenv.WaitFor(t, "the short connections to end", func() bool { return activeTotal(s) == want })
			}
			var got []int64
			for _, st := range s.EndpointStates() {
				got = append(got, st.Active)
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.want) {
				t.Errorf("long connections per endpoint = %v, want %v (%+v)", got, tc.want, s.EndpointStates())
			}
		})
	}
}

// TestUDPSessionsAreCounted checks that the UDP proxy reports its sessions: least-connections
// sends a second client to the idle endpoint, and a session's end releases its count.
func TestUDPSessionsAreCounted(t *testing.T) {
	var backends []netip.AddrPort
	for range 2 {
		pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		go func() {
			buf := make([]byte, 64)
			for {
				n, from, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				_, _ = pc.WriteTo(buf[:n], from)
			}
		}()
		backends = append(backends, pc.LocalAddr().(*net.UDPAddr).AddrPort())
	}
	lb := loadbalancer.New(clock.RealClock{})
	lb.SetBalancing(web, service.Balancing{Algorithm: service.LeastConnections})
	lb.SetEndpoints(web, backends)
	s := lb.Lookup(web)
	p := udp.New(web, s, udp.Config{})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.Run(ctx)
	}()
	defer func() {
		cancel()
		p.Close()
		<-done
	}()
	exchange := func() {
		c, err := net.Dial("udp4", p.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(make([]byte, 64)); err != nil {
			t.Fatalf("UDP reply through the proxy: %v", err)
		}
	}
	exchange()
	exchange() // a second client: least-connections sends it to the other endpoint
	for _, st := range s.EndpointStates() {
		if st.Active != 1 {
			t.Fatalf("sessions per endpoint = %+v, want one each", s.EndpointStates())
		}
	}
	if n := p.DropEndpoint(backends[0]); n != 1 {
		t.Fatalf("DropEndpoint ended %d sessions, want 1", n)
	}
	testenv.WaitFor(t, "the ended session to be released", func() bool { return activeTotal(s) == 1 })
}

// blackHole returns an endpoint that drops SYNs: a listener with a backlog of 0 whose accept
// queue is full with one connection nobody accepts, so a connect to it waits until the dial's
// deadline (the kernel retransmits the SYN only after a second).
func blackHole(t *testing.T) netip.AddrPort {
	return testenv.UnansweredTCP(t, netip.MustParseAddr("127.0.0.5"))
}

// TestOutlierEjectionOfABlackHole runs a real proxy over two echo endpoints and one that drops
// SYNs. Before ejection every third dial waits out its timeout; after two such failures the
// black hole is ejected and no connection pays a timeout any more, until its ejection time has
// passed (the balancer's clock is injected) and it is tried, and ejected, again, for twice as long.
func TestOutlierEjectionOfABlackHole(t *testing.T) {
	const dialTimeout = 200 * time.Millisecond
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	lb := loadbalancer.New(clk)
	var mu sync.Mutex
	var ejections []loadbalancer.Ejection
	lb.OnEjection(func(e loadbalancer.Ejection) {
		mu.Lock()
		ejections = append(ejections, e)
		mu.Unlock()
	})
	ejected := func() []loadbalancer.Ejection {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(ejections)
	}
	hole := blackHole(t)
	lb.SetBalancing(web, service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 2, EjectionTime: time.Minute, MaxEjectionPercent: 50}})
	lb.SetEndpoints(web, []netip.AddrPort{testenv.EchoTCP(t), hole, testenv.EchoTCP(t)})
	s := lb.Lookup(web)
	p := runProxy(t, s, tcp.Config{DialTimeouts: []time.Duration{dialTimeout, dialTimeout, dialTimeout}})
	addr := p.Addr().String()

	// connect opens, echoes and closes n connections one after another; it returns their mean
	// time to the first echo and how many dial timeouts the proxy paid meanwhile.
	connect := func(n int) (time.Duration, uint64) {
		failures := p.Stats().DialFailures
		start := time.Now()
		for range n {
			roundTrip(t, addr).Close()
		}
		return time.Since(start) / time.Duration(n), p.Stats().DialFailures - failures
	}
	var before time.Duration
	var paid uint64
	conns := 0
	for len(ejected()) == 0 {
		if conns >= 30 {
			t.Fatalf("no ejection after %d connections (%d dial timeouts)", conns, paid)
		}
		d, f := connect(1)
		before += d
		paid += f
		conns++
	}
	before /= time.Duration(conns)
	if e := ejected(); len(e) != 1 || e[0].Endpoint != hole || e[0].Failures != 2 || e[0].Duration != time.Minute {
		t.Fatalf("ejections = %+v, want %v for 1m after 2 failed dials", e, hole)
	}
	after, f := connect(30)
	t.Logf("before ejection: %d connections, %d dial timeouts of %v, %v per connection on average; after: %v per connection",
		conns, paid, dialTimeout, before.Round(time.Microsecond), after.Round(time.Microsecond))
	if paid != 2 || f != 0 {
		t.Errorf("dial timeouts paid: %d before ejection (want 2), %d in 30 connections after (want 0)", paid, f)
	}
	if states := s.EndpointStates(); !slices.ContainsFunc(states, func(st loadbalancer.EndpointState) bool {
		return st.Endpoint == hole && !st.EjectedUntil.IsZero()
	}) {
		t.Errorf("endpoint states %+v: want %v shown as ejected", states, hole)
	}

	// Its time is up: it is tried again, fails twice more and goes out for twice as long.
	clk.Step(time.Minute)
	for conns = 0; len(ejected()) == 1; conns++ {
		if conns >= 30 {
			t.Fatalf("the black hole was not ejected again after %d connections", conns)
		}
		connect(1)
	}
	if e := ejected(); e[1].Endpoint != hole || e[1].Ejections != 2 || e[1].Duration != 2*time.Minute {
		t.Errorf("second ejection = %+v, want %v out for 2m", e[1], hole)
	}
	if total, out := s.Outliers(); total != 2 || out != 1 {
		t.Errorf("Outliers() = %d total, %d out; want 2, 1", total, out)
	}
}

// resetter returns an endpoint that accepts every connection and resets it at once.
func resetter(t *testing.T) netip.AddrPort {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, l, func(c net.Conn) { _ = c.(*net.TCPConn).SetLinger(0) }) // closed on return: a reset
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// TestOutlierEjectionOfAResettingEndpoint: an endpoint that accepts and resets every connection
// before sending a byte is ejected after two such resets; then every connection gets an echo.
func TestOutlierEjectionOfAResettingEndpoint(t *testing.T) {
	lb := loadbalancer.New(clock.RealClock{})
	var mu sync.Mutex
	var ejections []loadbalancer.Ejection
	lb.OnEjection(func(e loadbalancer.Ejection) {
		mu.Lock()
		ejections = append(ejections, e)
		mu.Unlock()
	})
	bad := resetter(t)
	lb.SetBalancing(web, service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 2, EjectionTime: time.Hour, MaxEjectionPercent: 50}})
	lb.SetEndpoints(web, []netip.AddrPort{bad, testenv.EchoTCP(t)})
	s := lb.Lookup(web)
	addr := runProxy(t, s, tcp.Config{}).Addr().String()
	failed := 0
	for i := 0; ; i++ {
		mu.Lock()
		n := len(ejections)
		mu.Unlock()
		if n > 0 {
			break
		}
		if i >= 20 {
			t.Fatalf("no ejection after %d connections, %d reset", i, failed)
		}
		if !tryRoundTrip(addr) {
			failed++
		}
		// The proxy reports the end after both sockets close; wait for it before the next.
		testenv.WaitFor(t, "the connection to end", func() bool { return activeTotal(s) == 0 })
	}
	if e := ejections[0]; e.Endpoint != bad || !e.Reset || e.Failures != 2 {
		t.Errorf("ejection = %+v, want %v for 2 resets", e, bad)
	}
	for i := range 10 {
		if !tryRoundTrip(addr) {
			t.Fatalf("connection %d after the ejection failed", i)
		}
	}
}

// tryRoundTrip reports whether one connection through the proxy got its echo.
func tryRoundTrip(addr string) bool {
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return false
	}
	_, err = io.ReadFull(c, make([]byte, 4))
	return err == nil
}
