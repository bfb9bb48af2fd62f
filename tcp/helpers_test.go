package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan for every test in this package (loopback only):
//   127.0.0.1:0   the proxy port
//   127.0.0.2:0   a port that was bound then closed: dials to it are refused
//   127.0.0.3:0+  endpoints (test servers)
//   127.0.0.4:0   a listener whose full accept queue drops SYNs: dials to it time out
//   clients dial from 127.0.0.1

var testName = service.ServicePortName{Namespace: "default", Name: "web", Port: "http"}

// fakePicker hands out its endpoints round robin and records every call.
type fakePicker struct {
	mu    sync.Mutex
	eps   []netip.AddrPort
	i     int
	calls []pick
}

type pick struct {
	client netip.Addr
	reset  bool
}

func (f *fakePicker) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, pick{client, reset})
	if len(f.eps) == 0 {
		return netip.AddrPort{}, errors.New("no endpoints")
	}
	ep := f.eps[f.i%len(f.eps)]
	f.i++
	return ep, nil
}

func (f *fakePicker) picks() []pick {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]pick(nil), f.calls...)
}

// closedCh collects OnEnd reports.
type closedCh chan flow.Info

func (c closedCh) onClose(ci flow.Info) { c <- ci }

func (c closedCh) next(t *testing.T) flow.Info {
	t.Helper()
	select {
	case ci := <-c:
		return ci
	case <-time.After(10 * time.Second):
		t.Fatal("no connection closed within 10s")
		return flow.Info{}
	}
}

func testLogger(t testing.TB) logrus.FieldLogger {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return l
}

// startProxy listens on 127.0.0.1:0 and runs the accept loop until the test ends.
func startProxy(t *testing.T, picker Picker, cfg Config) *Proxy {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	p := New(testName, picker, cfg)
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatalf("Listen: %v", err)
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
	return p
}

// serve runs handler for each connection to a listener on ip:0 until the test ends.
func serve(t testing.TB, ip string, handler func(*net.TCPConn)) netip.AddrPort {
	t.Helper()
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(ip), 0)))
	if err != nil {
		t.Fatalf("listen on %s: %v", ip, err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []*net.TCPConn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handler(c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// echo copies back until EOF, then forwards the FIN.
func echo(c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
}

// refusedPort returns an address on 127.0.0.2 where nothing listens.
func refusedPort(t *testing.T) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.2:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	ap := ln.Addr().(*net.TCPAddr).AddrPort()
	ln.Close()
	return ap
}

// unansweredPort returns an endpoint that drops SYNs: a listener with a backlog of 0 whose accept
// queue is full with one connection nobody accepts, so a connect to it stays in SYN_SENT until
// the dial's deadline (the kernel retransmits the SYN only after a second).
func unansweredPort(t *testing.T) netip.AddrPort {
	return testenv.UnansweredTCP(t, netip.MustParseAddr("127.0.0.4"))
}

// dialExpectReset connects to the proxy and reads: the proxy may reset the connection before the
// handshake completes on the client side, so connect() itself may report the reset.
func dialExpectReset(t *testing.T, p *Proxy) error {
	t.Helper()
	c, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(p.Addr()))
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	_, err = c.Read(make([]byte, 1))
	return err
}

func dial(t *testing.T, p *Proxy) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(p.Addr()))
	if err != nil {
		t.Fatalf("dial proxy: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c
}

// roundTrip writes msg and reads len(msg) bytes back.
func roundTrip(t *testing.T, c *net.TCPConn, msg string) {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("write: %v", err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("read echo of %q: %v", msg, err)
	}
	if string(buf) != msg {
		t.Fatalf("echo (-want +got):\n-%q\n+%q", msg, buf)
	}
}

// modes runs a subtest with directions kept on goroutines and with directions parked in the idle
// watcher after 1ms, so both data paths see every behaviour.
var modes = []struct {
	name      string
	parkAfter time.Duration
}{
	{"running", time.Minute},
	{"parked", time.Millisecond},
}

// legFDs returns the descriptors of an established connection's client and endpoint sockets,
// whichever engine serves it.
func legFDs(c *conn) (client, endpoint int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t.legs()
}
