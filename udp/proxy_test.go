package udp

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"github.com/sirupsen/logrus"
	"net"
	"net/netip"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

func TestProxy_echoRoundTrip(t *testing.T) {
	backend := echoServer(t, "127.0.0.2", "b1:")
	p := startProxy(t, newFakePicker(backend), Config{})
	c := newClient(t, "127.0.0.1", p.Addr())

	for i := range 3 {
		msg := fmt.Sprintf("query-%d", i)
		if got, want := c.roundTrip(msg), "b1:"+msg; got != want {
			t.Errorf("round trip %d: got %q, want %q", i, got, want)
		}
	}
	// The counters of a reply are updated once its sendmmsg returns, which may be after the client
	// has it.
	testenv.WaitFor(t, "reply counters", func() bool { return p.Stats().PacketsToClient == 3 })
	st := p.Stats()
	want := flow.Stats{Active: 1, Total: 1, PacketsToEndpoint: 3, BytesToEndpoint: 21,
		PacketsToClient: 3, BytesToClient: 30}
	if st != want {
		t.Errorf("Stats() (-want +got):\n-%+v\n+%+v", want, st)
	}
}

func TestProxy_parallelClientsGetTheirOwnReplies(t *testing.T) {
	const clients, rounds = 32, 50
	backend := echoServer(t, "127.0.0.2", "")
	p := startProxy(t, newFakePicker(backend), Config{})

	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		c := newClient(t, "127.0.0.1", p.Addr())
		wg.Go(func() {
			for r := range rounds {
				msg := fmt.Sprintf("client-%d-round-%d", i, r)
				c.send([]byte(msg))
				got, err := c.recv()
				if err != nil {
					errs <- err
					return
				}
				if string(got) != msg {
					errs <- fmt.Errorf("client %d got %q, want %q", i, got, msg)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := p.Stats().Total; got != clients {
		t.Errorf("Total = %d, want one per client (%d)", got, clients)
	}
}

func TestProxy_largestDatagramIntact(t *testing.T) {
	backend := echoServer(t, "127.0.0.2", "")
	p := startProxy(t, newFakePicker(backend), Config{})
	c := newClient(t, "127.0.0.1", p.Addr())

	for _, size := range []int{0, 1, 4096, 4097, 65507} {
		msg := make([]byte, size)
		rand.Read(msg)
		c.send(msg)
		got, err := c.recv()
		if err != nil {
			t.Fatalf("size %d: %v", size, err)
		}
		if !bytes.Equal(got, msg) {
			t.Errorf("size %d: reply of %d bytes differs from the datagram sent", size, len(got))
		}
	}
	if st := p.Stats(); st.DropsTruncated != 0 {
		t.Errorf("DropsTruncated = %d, want 0", st.DropsTruncated)
	}
}

// stepAndSweep advances the fake clock by d and waits until the expiry timer has fired and been
// re-armed, i.e. the sweep for the new time is done.
func stepAndSweep(t *testing.T, fc *clocktesting.FakeClock, d time.Duration) {
	t.Helper()
	testenv.WaitFor(t, "expiry timer armed", fc.HasWaiters)
	fc.Step(d)
	testenv.WaitFor(t, "expiry sweep", fc.HasWaiters)
}

func TestProxy_idleExpirySlidesOnTrafficBothWays(t *testing.T) {
	const timeout = 10 * time.Second
	fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	backend := echoServer(t, "127.0.0.2", "")
	var mu sync.Mutex
	var ended []flow.Info
	p := startProxy(t, newFakePicker(backend), Config{IdleTimeout: timeout, Clock: fc,
		OnEnd: func(s flow.Info) { mu.Lock(); ended = append(ended, s); mu.Unlock() }})
	c := newClient(t, "127.0.0.1", p.Addr())

	c.roundTrip("q1") // t=0
	stepAndSweep(t, fc, 6*time.Second)
	if n := len(p.Live()); n != 1 {
		t.Fatalf("at 6s: %d sessions, want 1", n)
	}
	c.roundTrip("q2") // t=6s: the deadline moves to 16s
	stepAndSweep(t, fc, 6*time.Second)
	if n := len(p.Live()); n != 1 {
		t.Fatalf("at 12s, 6s after the last traffic: %d sessions, want 1", n)
	}
	stepAndSweep(t, fc, 5*time.Second)
	if n := len(p.Live()); n != 0 {
		t.Fatalf("at 17s, 11s after the last traffic: %d sessions, want 0", n)
	}
	if got := p.Stats(); got.Ended[flow.IdleTimeout] != 1 || got.Active != 0 {
		t.Errorf("Stats() = %+v, want Ended[idle-timeout] 1, Active 0", got)
	}
	mu.Lock()
	got := ended
	mu.Unlock()
	want := []flow.Info{{
		Client: c.addr(), Endpoint: backend,
		Start: fc.Now().Add(-17 * time.Second), LastActive: fc.Now().Add(-11 * time.Second),
		Duration:          17 * time.Second,
		PacketsToEndpoint: 2, BytesToEndpoint: 4, PacketsToClient: 2, BytesToClient: 4,
		End: flow.IdleTimeout,
	}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("OnEnd (-want +got):\n-%+v\n+%+v", want, got)
	}
	if got, want := c.roundTrip("q3"), "q3"; got != want {
		t.Errorf("after expiry: got %q, want %q", got, want)
	}
	if got := p.Stats().Total; got != 2 {
		t.Errorf("Total = %d, want 2 (a new session after expiry)", got)
	}
}

// A reply alone (a late DNS answer, say) keeps the session alive.
func TestProxy_idleExpirySlidesOnReplies(t *testing.T) {
	const timeout = 10 * time.Second
	fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	backend := newClient(t, "127.0.0.2", netip.AddrPort{}) // a hand-driven endpoint
	p := startProxy(t, newFakePicker(backend.addr()), Config{IdleTimeout: timeout, Clock: fc})
	c := newClient(t, "127.0.0.1", p.Addr())

	c.send([]byte("q")) // t=0
	buf := make([]byte, 64)
	backend.conn.SetReadDeadline(time.Now().Add(waitTimeout))
	_, session, err := backend.conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatal(err)
	}
	stepAndSweep(t, fc, 8*time.Second)
	if _, err := backend.conn.WriteToUDPAddrPort([]byte("late answer"), session); err != nil {
		t.Fatal(err)
	}
	if got, err := c.recv(); err != nil || string(got) != "late answer" {
		t.Fatalf("late answer at 8s: got %q, %v", got, err)
	}
	stepAndSweep(t, fc, 8*time.Second) // 16s: 8s after the reply
	if n := len(p.Live()); n != 1 {
		t.Errorf("8s after the last reply: %d sessions, want 1", n)
	}
}

func TestProxy_affinityAndRoundRobin(t *testing.T) {
	b1 := echoServer(t, "127.0.0.2", "b1:")
	b2 := echoServer(t, "127.0.0.3", "b2:")
	picker := newFakePicker(b1, b2)
	p := startProxy(t, picker, Config{})

	tests := []struct {
		clientIP string
		want     string
	}{
		{"127.0.0.10", "b1:x"}, // first client IP: first endpoint
		{"127.0.0.10", "b1:x"}, // same IP, another source port: same endpoint
		{"127.0.0.11", "b2:x"}, // next client IP: next endpoint
		{"127.0.0.12", "b1:x"},
		{"127.0.0.11", "b2:x"},
	}
	var want []pick
	for i, tt := range tests {
		c := newClient(t, tt.clientIP, p.Addr())
		if got := c.roundTrip("x"); got != tt.want {
			t.Errorf("client %d from %s: got %q, want %q", i, tt.clientIP, got, tt.want)
		}
		// A session per client address, each picked with the client's IP.
		want = append(want, pick{Client: netip.MustParseAddr(tt.clientIP)})
	}
	if got := picker.Calls(); !slices.Equal(got, want) {
		t.Errorf("picker calls (-want +got):\n-%v\n+%v", want, got)
	}
}

func TestProxy_sessionCapEvictsLeastRecentlyUsed(t *testing.T) {
	backend := echoServer(t, "127.0.0.2", "")
	var mu sync.Mutex
	var evicted []netip.AddrPort
	// One loop: the cap and the LRU order are per loop.
	p := startProxy(t, newFakePicker(backend), Config{MaxSessions: 2, Loops: 1, OnEnd: func(s flow.Info) {
		mu.Lock()
		defer mu.Unlock()
		if s.End == flow.Evicted {
			evicted = append(evicted, s.Client)
		}
	}})
	c1 := newClient(t, "127.0.0.1", p.Addr())
	c2 := newClient(t, "127.0.0.1", p.Addr())
	c3 := newClient(t, "127.0.0.1", p.Addr())

	c1.roundTrip("1")
	c2.roundTrip("2")
	c1.roundTrip("1 again") // c2 is now the least recently used
	c3.roundTrip("3")       // evicts c2

	clientsOf := func() []netip.AddrPort {
		var out []netip.AddrPort
		for _, s := range p.Live() {
			out = append(out, s.Client)
		}
		slices.SortFunc(out, netip.AddrPort.Compare)
		return out
	}
	want := []netip.AddrPort{c1.addr(), c3.addr()}
	slices.SortFunc(want, netip.AddrPort.Compare)
	if got := clientsOf(); !slices.Equal(got, want) {
		t.Errorf("sessions (-want +got):\n-%v\n+%v", want, got)
	}
	if got := p.Stats(); got.Ended[flow.Evicted] != 1 || got.Active != 2 {
		t.Errorf("Stats() = %+v, want Ended[evicted] 1, Active 2", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []netip.AddrPort{c2.addr()}; !slices.Equal(evicted, want) {
		t.Errorf("evicted (-want +got):\n-%v\n+%v", want, evicted)
	}
}

func TestProxy_sessionCapBoundsSpoofedFlood(t *testing.T) {
	const maxSessions, sources = 8, 200
	backend := echoServer(t, "127.0.0.2", "")
	p := startProxy(t, newFakePicker(backend), Config{MaxSessions: maxSessions, Loops: 1})
	baseFDs := countFDs(t)

	// Each source is a fresh socket on its own loopback address (a reused ephemeral port on one
	// address could land on a live session, making the count flaky); only the newest maxSessions
	// keep a session. One at a time, so that no datagram is lost and the counts are exact.
	for i := range sources {
		c := newClient(t, fmt.Sprintf("127.0.%d.%d", 10+i/250, 1+i%250), p.Addr())
		c.send([]byte("flood"))
		c.conn.Close()
		testenv.WaitFor(t, fmt.Sprintf("session %d", i+1), func() bool { return p.Stats().Total == uint64(i+1) })
	}
	st := p.Stats()
	if st.Active != maxSessions || st.Ended[flow.Evicted] != sources-maxSessions {
		t.Errorf("Stats() = %+v, want Active %d, Ended[evicted] %d", st, maxSessions, sources-maxSessions)
	}
	if got := countFDs(t); got > baseFDs+maxSessions {
		t.Errorf("open descriptors grew from %d to %d, want at most %d more", baseFDs, got, maxSessions)
	}
}

func TestProxy_endpointChangeMidSession(t *testing.T) {
	b1 := echoServer(t, "127.0.0.2", "b1:")
	b2 := echoServer(t, "127.0.0.3", "b2:")
	picker := newFakePicker(b1)
	p := startProxy(t, picker, Config{})
	c := newClient(t, "127.0.0.1", p.Addr())

	if got, want := c.roundTrip("x"), "b1:x"; got != want {
		t.Fatalf("before the change: got %q, want %q", got, want)
	}
	picker.setEndpoints(b2) // b1 went away
	if got, want := p.DropEndpoint(b1), 1; got != want {
		t.Errorf("DropEndpoint(b1) = %d, want %d", got, want)
	}
	if got, want := c.roundTrip("y"), "b2:y"; got != want {
		t.Errorf("after the change: got %q, want %q", got, want)
	}
	if got, want := p.DropEndpoint(b1), 0; got != want {
		t.Errorf("DropEndpoint(b1) again = %d, want %d", got, want)
	}
	if got := p.Stats(); got.Ended[flow.EndpointRemoved] != 1 || got.Total != 2 {
		t.Errorf("Stats() = %+v, want Ended[endpoint-removed] 1, Total 2", got)
	}
}

func TestProxy_refusedEndpointFailsOver(t *testing.T) {
	dead := closedPort(t, "127.0.0.9")
	live := echoServer(t, "127.0.0.2", "live:")
	picker := newFakePicker(dead, live)
	var mu sync.Mutex
	var reasons []flow.EndReason
	p := startProxy(t, picker, Config{OnEnd: func(s flow.Info) {
		mu.Lock()
		defer mu.Unlock()
		reasons = append(reasons, s.End)
	}})
	c := newClient(t, "127.0.0.1", p.Addr())

	c.send([]byte("lost")) // to the dead endpoint: ICMP port unreachable
	testenv.WaitFor(t, "the refusal", func() bool { return p.Stats().Ended[flow.EndpointRefused] == 1 })
	if got, want := c.roundTrip("retry"), "live:retry"; got != want {
		t.Errorf("after the refusal: got %q, want %q", got, want)
	}
	client := netip.MustParseAddr("127.0.0.1")
	if got, want := picker.Calls(), []pick{{client, false}, {client, true}}; !slices.Equal(got, want) {
		t.Errorf("picker calls (-want +got):\n-%v\n+%v", want, got)
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []flow.EndReason{flow.EndpointRefused}; !slices.Equal(reasons, want) {
		t.Errorf("ended sessions (-want +got):\n-%v\n+%v", want, reasons)
	}
}

func TestProxy_noEndpointDropsDatagram(t *testing.T) {
	p := startProxy(t, newFakePicker(), Config{})
	c := newClient(t, "127.0.0.1", p.Addr())
	c.send([]byte("nobody home"))
	testenv.WaitFor(t, "the drop", func() bool { return p.Stats().NoEndpoint == 1 })
	if n := len(p.Live()); n != 0 {
		t.Errorf("%d sessions, want 0", n)
	}
}

func countFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func TestProxy_closeLeaksNothing(t *testing.T) {
	backend := echoServer(t, "127.0.0.2", "")
	tests := []struct {
		name string
		stop func(p *Proxy, cancel context.CancelFunc)
	}{
		{"Close", func(p *Proxy, _ context.CancelFunc) { p.Close() }},
		{"context cancelled", func(_ *Proxy, cancel context.CancelFunc) { cancel() }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fds, goroutines := countFDs(t), runtime.NumGoroutine()
			p := New(testService, newFakePicker(backend), Config{})
			if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- p.Run(ctx) }()
			var clients []*client
			for range 20 {
				c := newClient(t, "127.0.0.1", p.Addr())
				c.roundTrip("x")
				clients = append(clients, c)
			}
			for _, c := range clients {
				c.conn.Close()
			}
			if got := p.Stats().Active; got != 20 {
				t.Fatalf("Active = %d, want 20", got)
			}
			tt.stop(p, cancel)
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(waitTimeout):
				t.Fatal("Run did not return")
			}
			if got := p.Stats(); got.Active != 0 || got.Ended[flow.Shutdown] != 20 {
				t.Errorf("Stats() = %+v, want Active 0, Ended[shutdown] 20", got)
			}
			testenv.WaitFor(t, fmt.Sprintf("descriptors back to %d", fds), func() bool { return countFDs(t) == fds })
			testenv.WaitFor(t, fmt.Sprintf("goroutines back to %d", goroutines), func() bool {
				return runtime.NumGoroutine() <= goroutines
			})
			if err := p.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		})
	}
}

func TestProxy_closeWithoutRun(t *testing.T) {
	fds := countFDs(t)
	p := New(testService, newFakePicker(), Config{})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if got := countFDs(t); got != fds {
		t.Errorf("descriptors: %d after Close, want %d", got, fds)
	}
	if err := p.Run(context.Background()); err != nil {
		t.Errorf("Run after Close = %v, want nil", err)
	}
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err == nil {
		t.Errorf("Listen after Close succeeded, want an error")
	}
}

func TestProxy_ipv6RoundTrip(t *testing.T) {
	backendConn, err := net.ListenUDP("udp6", &net.UDPAddr{IP: net.IPv6loopback})
	if err != nil {
		testenv.Unavailable(t, "no IPv6 loopback: %v", err)
	}
	defer backendConn.Close()
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := backendConn.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			backendConn.WriteToUDPAddrPort(buf[:n], from)
		}
	}()
	backend := backendConn.LocalAddr().(*net.UDPAddr).AddrPort()
	p := New(testService, newFakePicker(backend), Config{})
	if err := p.Listen(netip.MustParseAddrPort("[::1]:0")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	defer func() { cancel(); <-done }()

	c, err := net.DialUDP("udp6", nil, net.UDPAddrFromAddrPort(p.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("v6"))
	c.SetReadDeadline(time.Now().Add(waitTimeout))
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil || string(buf[:n]) != "v6" {
		t.Errorf("round trip over ::1: got %q, %v; want \"v6\"", buf[:n], err)
	}
	want := []netip.AddrPort{c.LocalAddr().(*net.UDPAddr).AddrPort()}
	var got []netip.AddrPort
	for _, s := range p.Live() {
		got = append(got, s.Client)
	}
	if !slices.Equal(got, want) {
		t.Errorf("session clients (-want +got):\n-%v\n+%v", want, got)
	}
}

// TestIdleServicePortsHoldNoThreads: an idle UDP service port waits in the Go netpoller, not in a
// blocking epoll_wait, so hundreds of them add no OS threads (the runtime dies at 10,000), while
// traffic still flows through each of them.
func TestIdleServicePortsHoldNoThreads(t *testing.T) {
	threads := func() int {
		b, err := os.ReadFile("/proc/self/status")
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "Threads:"); ok {
				n, _ := strconv.Atoi(strings.TrimSpace(v))
				return n
			}
		}
		t.Fatal("no Threads line")
		return 0
	}
	ep := echoServer(t, "127.0.0.1", "a")
	before := threads()
	var proxies []*Proxy
	for range 200 {
		proxies = append(proxies, startProxy(t, newFakePicker(ep), Config{Logger: logrus.New()}))
	}
	// Every proxy answers (each one has been busy once, then goes idle again).
	for _, p := range proxies[:20] {
		c, err := net.Dial("udp4", p.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(waitTimeout))
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Read(make([]byte, 64)); err != nil {
			t.Fatalf("no reply through %s: %v", p.Addr(), err)
		}
		c.Close()
	}
	if grown := threads() - before; grown > 60 {
		t.Errorf("200 mostly idle UDP proxies added %d OS threads, want far fewer than one each", grown)
	}
}
