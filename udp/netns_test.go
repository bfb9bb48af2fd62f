package udp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// A proxy listening on a wildcard address answers from the address each client sent to, as the
// portal's conntrack entry requires, not from whatever address routing would pick.
//
// Address plan, inside a throwaway namespace with only lo up (the wildcard listener never exists
// in the root namespace):
//
//	0.0.0.0:P     the proxy
//	127.0.0.2:0   the echo endpoint
//	127.0.0.1:0   clients, sending to 127.0.0.5:P and 127.0.0.1:P
func TestProxy_repliesFromTheAddressTheClientSentTo(t *testing.T) {
	ns := netns.NewTestLab(t).MustAdd(t, "udp")

	type sockets struct {
		p            *Proxy
		echo, c1, c2 *net.UDPConn
	}
	ready := make(chan sockets, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		// Run goes inside Do too: it opens the backend sockets, which must be in the namespace.
		done <- ns.Do(func() error {
			var s sockets
			var err error
			listen := func(ap string) *net.UDPConn {
				c, lerr := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(ap)))
				err = errors.Join(err, lerr)
				return c
			}
			s.echo, s.c1, s.c2 = listen("127.0.0.2:0"), listen("127.0.0.1:0"), listen("127.0.0.1:0")
			if err != nil {
				close(ready)
				return err
			}
			s.p = New(testService, newFakePicker(s.echo.LocalAddr().(*net.UDPAddr).AddrPort()), Config{})
			if err := s.p.Listen(netip.MustParseAddrPort("0.0.0.0:0")); err != nil {
				close(ready)
				return err
			}
			ready <- s
			return s.p.Run(ctx)
		})
	}()
	s, ok := <-ready
	if !ok {
		t.Fatalf("set up in the namespace: %v", <-done)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		s.echo.Close()
		s.c1.Close()
		s.c2.Close()
	}()
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := s.echo.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			s.echo.WriteToUDPAddrPort(buf[:n], from)
		}
	}()

	port := s.p.Addr().Port()
	tests := []struct {
		name string
		conn *net.UDPConn
		to   netip.Addr
	}{
		{"to 127.0.0.5, not the routing choice 127.0.0.1", s.c1, netip.MustParseAddr("127.0.0.5")},
		{"to 127.0.0.1", s.c2, netip.MustParseAddr("127.0.0.1")},
		{"same client, another local address", s.c1, netip.MustParseAddr("127.0.0.7")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			to := netip.AddrPortFrom(tt.to, port)
			if _, err := tt.conn.WriteToUDPAddrPort([]byte("q"), to); err != nil {
				t.Fatal(err)
			}
			tt.conn.SetReadDeadline(time.Now().Add(waitTimeout))
			buf := make([]byte, 512)
			_, from, err := tt.conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				t.Fatal(err)
			}
			if from != to {
				t.Errorf("reply from %s, want %s (where the client sent it)", from, to)
			}
		})
	}
}

// TestLoopsOpenSessionSocketsInTheCallersNamespace: a proxy run inside a namespace serves the
// clients of every loop there, also those of the loops Run starts on goroutines of their own (a
// session socket opened in the root namespace would reach no echo server: nothing listens on its
// port there).
//
// Address plan, inside a throwaway namespace with only lo up: the proxy on 127.0.0.1:0 with two
// loops, the echo endpoint on 127.0.0.2:0, 16 clients on 127.0.0.1:0.
func TestLoopsOpenSessionSocketsInTheCallersNamespace(t *testing.T) {
	ns := netns.NewTestLab(t).MustAdd(t, "udp")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan *Proxy, 1)
	done := make(chan error, 1)
	go func() {
		done <- ns.Do(func() error {
			echo, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.2:0")))
			if err != nil {
				close(ready)
				return err
			}
			defer echo.Close()
			go func() {
				buf := make([]byte, 512)
				for {
					n, from, err := echo.ReadFromUDPAddrPort(buf)
					if err != nil {
						return
					}
					echo.WriteToUDPAddrPort(buf[:n], from)
				}
			}()
			p := New(testService, newFakePicker(echo.LocalAddr().(*net.UDPAddr).AddrPort()), Config{Loops: 2, Logger: quietLogger()})
			if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
				close(ready)
				return err
			}
			ready <- p
			return p.Run(ctx)
		})
	}()
	p, ok := <-ready
	if !ok {
		t.Fatalf("set up in the namespace: %v", <-done)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	err := ns.Do(func() error {
		for i := range 16 {
			c, err := net.Dial("udp", p.Addr().String())
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(waitTimeout))
			if _, err := c.Write([]byte("q")); err != nil {
				return err
			}
			if _, err := c.Read(make([]byte, 64)); err != nil {
				return fmt.Errorf("client %d: %w", i, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if per := sessionsPerShard(p); len(per) != 2 || per[0] == 0 || per[1] == 0 {
		t.Errorf("sessions per loop = %v, want both loops serving some of the 16 clients", per)
	}
}
