package proxier

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestHandOff runs a real proxier with a real TCP socket on the loopback "service IP"
// 127.0.0.60 (a listen plan, as in bind mode) and an echo endpoint on 127.0.0.1, and hands off:
// no new connection is accepted, the established one goes on until it ends (or the drain
// deadline), and only then does Run return.
func TestHandOff(t *testing.T) {
	for _, tc := range []struct {
		name     string
		deadline bool // the drain deadline passes while the connection is open
	}{
		{name: "an_established_connection_finishes_then_Run_returns"},
		{name: "the_drain_deadline_ends_what_is_still_open", deadline: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			echo := echoTCP(t)
			at := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.60"), testenv.FreeTCPPort(t, "127.0.0.60"))
			p := New(Config{MinSyncPeriod: 10 * time.Millisecond, SyncPeriod: time.Minute,
				ListenPlan: func(*service.Port) []netip.AddrPort { return []netip.AddrPort{at} }},
				Deps{Balancer: loadbalancer.New(clock.RealClock{}), Portals: &recordingPortals{}, Sockets: RealSockets(SocketConfig{})})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan struct{})
			go func() { defer close(done); p.Run(ctx) }()
			p.OnServiceAdd(makeService("ns", "web", "127.0.0.60", nil, tcpPort("http", int32(at.Port()))))
			p.OnEndpointSliceAdd(makeSlice("ns", "web", "a", discovery.AddressTypeIPv4,
				[]discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, int32(echo.Port()))}, sliceEP{addr: "127.0.0.1"}))
			p.OnServicesSynced()
			p.OnEndpointSlicesSynced()
			var c net.Conn
			testenv.WaitFor(t, "the service to answer", func() bool {
				if c == nil {
					c, _ = net.DialTimeout("tcp4", at.String(), time.Second)
				}
				return c != nil && exchange(c, "ping") == nil
			})
			defer c.Close()

			drain, endDrain := context.WithCancel(context.Background())
			defer endDrain()
			p.HandOff(drain)
			testenv.WaitFor(t, "new connections to be refused (the socket stopped accepting)", func() bool {
				nc, err := net.DialTimeout("tcp4", at.String(), time.Second)
				if err == nil {
					nc.Close()
				}
				return errors.Is(err, syscall.ECONNREFUSED)
			})
			if err := exchange(c, "still served after the hand-off"); err != nil {
				t.Fatalf("the established connection after the hand-off: %v", err)
			}
			select {
			case <-done:
				t.Fatal("Run returned while a connection was still open")
			default:
			}
			if tc.deadline {
				endDrain()
			} else {
				c.Close()
			}
			testenv.WaitFor(t, "Run to return", func() bool {
				select {
				case <-done:
					return true
				default:
					return false
				}
			})
			if tc.deadline {
				c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err := c.Read(make([]byte, 1)); err == nil {
					t.Error("the connection still open at the drain deadline was not ended")
				}
			}
		})
	}
}

// exchange writes msg and reads its echo.
func exchange(c net.Conn, msg string) error {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return errors.New("wrong echo " + string(buf))
	}
	return nil
}
