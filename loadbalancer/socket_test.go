package loadbalancer_test

// Address plan: three TCP echo endpoints and the proxy listen on 127.0.0.1, kernel-chosen ports;
// clients dial the proxy from 127.0.0.1.

import (
	"context"
	"io"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

var web = service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}

// echoServer serves echo on a loopback listener until the test ends.
func echoServer(t *testing.T) netip.AddrPort {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// proxyFor runs a real TCP proxy socket for the balancer's service port.
func proxyFor(t *testing.T, s *loadbalancer.Service) string {
	t.Helper()
	p := tcp.New(web, s, tcp.Config{})
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
	return p.Addr().String()
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
			lb.SetEndpoints(web, []netip.AddrPort{echoServer(t), echoServer(t), echoServer(t)})
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
