package udp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan of these tests (loopback only):
//
//	127.0.0.1:0        the proxy's listening socket
//	127.0.0.2:0 ...    echo backends (endpoints), one address each
//	127.0.0.1x:0       clients; tests that need distinct client IPs bind 127.0.0.10, .11, ...
//	127.0.0.9:<closed> an endpoint with nothing listening (ICMP port unreachable)

var testService = service.ServicePortName{Namespace: "default", Name: "dns", Port: "dns"}

const waitTimeout = 10 * time.Second

// pick is one call of the fake picker.
type pick struct {
	Client netip.Addr
	Reset  bool
}

// fakePicker gives each new client IP the next endpoint in turn and keeps it (ClientIP affinity);
// reset moves the client to the next endpoint. It records every call.
type fakePicker struct {
	mu        sync.Mutex
	endpoints []netip.AddrPort
	next      int
	sticky    map[netip.Addr]netip.AddrPort
	calls     []pick
}

func newFakePicker(eps ...netip.AddrPort) *fakePicker {
	return &fakePicker{endpoints: eps, sticky: map[netip.Addr]netip.AddrPort{}}
}

func (f *fakePicker) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, pick{client, reset})
	if ep, ok := f.sticky[client]; ok && !reset {
		return ep, nil
	}
	if len(f.endpoints) == 0 {
		return netip.AddrPort{}, errors.New("no endpoints")
	}
	ep := f.endpoints[f.next%len(f.endpoints)]
	f.next++
	f.sticky[client] = ep
	return ep, nil
}

// setEndpoints replaces the endpoints and forgets affinity, as the load balancer does when an
// endpoint goes away.
func (f *fakePicker) setEndpoints(eps ...netip.AddrPort) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.endpoints, f.next, f.sticky = eps, 0, map[netip.Addr]netip.AddrPort{}
}

func (f *fakePicker) Calls() []pick {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]pick(nil), f.calls...)
}

// echoServer answers every datagram with tag + datagram. It stops at test cleanup.
func echoServer(t *testing.T, ip, tag string) netip.AddrPort {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(ip+":0")))
	if err != nil {
		t.Fatalf("echo server on %s: %v", ip, err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, bufSize)
		for {
			n, from, err := conn.ReadFromUDPAddrPort(buf[len(tag):])
			if err != nil {
				return
			}
			copy(buf, tag)
			if _, err := conn.WriteToUDPAddrPort(buf[:len(tag)+n], from); err != nil {
				return
			}
		}
	})
	t.Cleanup(func() {
		conn.Close()
		wg.Wait()
	})
	return conn.LocalAddr().(*net.UDPAddr).AddrPort()
}

// closedPort returns an address on ip where nothing listens.
func closedPort(t *testing.T, ip string) netip.AddrPort {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(ip+":0")))
	if err != nil {
		t.Fatal(err)
	}
	ap := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	conn.Close()
	return ap
}

// startProxy listens on 127.0.0.1:0 and runs the proxy until test cleanup, which also checks that
// Run returned without error.
func startProxy(t *testing.T, picker Picker, cfg Config) *Proxy {
	t.Helper()
	if cfg.Logger == nil {
		l := logrus.New()
		l.SetLevel(logrus.DebugLevel)
		l.SetOutput(testWriter{t})
		cfg.Logger = l
	}
	p := New(testService, picker, cfg)
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(waitTimeout):
			t.Errorf("Run did not return after cancel")
		}
	})
	return p
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(b))
	return len(b), nil
}

// client is a UDP socket talking to the proxy from a chosen loopback address.
type client struct {
	t    *testing.T
	conn *net.UDPConn
	to   netip.AddrPort
}

func newClient(t *testing.T, ip string, to netip.AddrPort) *client {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(ip+":0")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &client{t: t, conn: conn, to: to}
}

func (c *client) addr() netip.AddrPort { return c.conn.LocalAddr().(*net.UDPAddr).AddrPort() }

func (c *client) send(msg []byte) {
	c.t.Helper()
	if _, err := c.conn.WriteToUDPAddrPort(msg, c.to); err != nil {
		c.t.Fatalf("client %s send: %v", c.addr(), err)
	}
}

// recv returns the next datagram, which must come from the proxy's address.
func (c *client) recv() ([]byte, error) {
	buf := make([]byte, bufSize)
	c.conn.SetReadDeadline(time.Now().Add(waitTimeout))
	n, from, err := c.conn.ReadFromUDPAddrPort(buf)
	if err != nil {
		return nil, fmt.Errorf("client %s recv: %w", c.addr(), err)
	}
	if from != c.to {
		return nil, fmt.Errorf("client %s: reply from %s, want the proxy %s", c.addr(), from, c.to)
	}
	return buf[:n], nil
}

// roundTrip sends msg and returns the reply.
func (c *client) roundTrip(msg string) string {
	c.t.Helper()
	c.send([]byte(msg))
	got, err := c.recv()
	if err != nil {
		c.t.Fatal(err)
	}
	return string(got)
}
