package proxier

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
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

// TestBindModeReopenWithRealSockets restarts a bind-mode proxier with real loopback sockets: the
// "cluster IP" 127.0.0.60 and "load-balancer IP" 127.0.0.61 are loopback addresses, as bind mode
// listens on service IPs. The endpoint is an echo server on 127.0.0.1; clients dial from
// 127.0.0.5 (inside the source range) and 127.0.0.6 (outside). The first proxier's listen state
// seeds the second, which must listen before it knows any Service.
func TestBindModeReopenWithRealSockets(t *testing.T) {
	echo := echoTCP(t)
	// A port free on 127.0.0.60, for the service port.
	port := testenv.FreeTCPPort(t, "127.0.0.60")
	cluster, lb := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.60"), port), netip.AddrPortFrom(netip.MustParseAddr("127.0.0.61"), port)
	web := service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}

	var saved []Seed
	start := func() (*Proxier, func()) {
		p := New(Config{MinSyncPeriod: time.Second, SyncPeriod: time.Minute,
			ListenPlan:  func(*service.Port) []netip.AddrPort { return []netip.AddrPort{cluster, lb} },
			ListenState: func(s []Seed) { saved = s },
		}, Deps{Balancer: loadbalancer.New(clock.RealClock{}), Portals: &recordingPortals{}, Sockets: RealSockets(SocketConfig{})})
		ctx, cancel := context.WithCancel(context.Background())
		p.paths.runCtx = ctx
		return p, func() { cancel(); p.shutdown() }
	}
	feed := func(p *Proxier) {
		p.OnServiceAdd(makeService("ns", "web", "127.0.0.60", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeLoadBalancer
			s.Spec.Ports[0].NodePort = 30080
			s.Spec.LoadBalancerSourceRanges = []string{"127.0.0.5/32"}
			s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "127.0.0.61"}}
		}, tcpPort("http", int32(port))))
		p.OnEndpointSliceAdd(makeSlice("ns", "web", "a", discovery.AddressTypeIPv4,
			[]discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, int32(echo.Port()))}, sliceEP{addr: "127.0.0.1"}))
		p.OnServicesSynced()
		p.OnEndpointSlicesSynced()
	}
	dial := func(from string, to netip.AddrPort) (string, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp4", to.String())
		if err != nil {
			return "", err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(8 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return "", err
		}
		buf := make([]byte, 4)
		_, err = io.ReadFull(c, buf)
		return string(buf), err
	}

	first, stopFirst := start()
	feed(first)
	if err := first.sync(first.paths.runCtx); err != nil {
		t.Fatal(err)
	}
	t.Run("a_sync_saves_where_each_port_listens", func(t *testing.T) {
		if len(saved) != 1 || saved[0].Name != web || saved[0].Protocol != service.TCP || saved[0].ProxyPort != port ||
			!sameAddrs(saved[0].Listen, []netip.AddrPort{cluster, lb}) || len(saved[0].External) != 0 ||
			!slices.Equal(saved[0].LoadBalancerIPs, []netip.Addr{lb.Addr()}) || len(saved[0].SourceRanges) != 1 {
			t.Fatalf("saved listen state = %+v; want ns/web:http on %v and %v with its source range", saved, cluster, lb)
		}
	})
	stopFirst()
	if _, err := dial("127.0.0.5", cluster); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("after the first proxier stopped: %v; want ECONNREFUSED", err)
	}

	second, stopSecond := start()
	t.Cleanup(stopSecond)
	second.Reopen(saved)
	saved = nil
	second.paths.reopen()
	reopened := second.paths.socketOf(web)

	t.Run("reopened_sockets_check_source_ranges_before_the_first_sync", func(t *testing.T) {
		if got, err := dial("127.0.0.6", lb); !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
			t.Errorf("from 127.0.0.6 (outside the range) to %s: %q, %v; want a reset", lb, got, err)
		}
	})

	// A client connecting before any Service is known is accepted (something listens) and held
	// until the endpoints are in, then served.
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.5")}, Timeout: 5 * time.Second}
	early, err := d.Dial("tcp4", cluster.String())
	if err != nil {
		t.Fatalf("connect to %s before the first sync: %v; want the reopened socket to accept", cluster, err)
	}
	defer early.Close()
	if _, err := early.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	feed(second)
	if err := second.sync(second.paths.runCtx); err != nil {
		t.Fatal(err)
	}
	t.Run("a_connection_made_before_the_first_sync_is_served", func(t *testing.T) {
		_ = early.SetDeadline(time.Now().Add(8 * time.Second))
		buf := make([]byte, 4)
		if _, err := io.ReadFull(early, buf); err != nil || string(buf) != "ping" {
			t.Errorf("connection made before the first sync: %q, %v; want the echo", buf, err)
		}
	})
	t.Run("the_first_sync_keeps_the_reopened_sockets", func(t *testing.T) {
		if a := second.paths.socketOf(web); a == nil || a != reopened {
			t.Errorf("active socket after the first sync = %p, want the reopened %p", a, reopened)
		}
		if got, err := dial("127.0.0.5", lb); err != nil || got != "ping" {
			t.Errorf("to %s after the first sync: %q, %v; want the echo", lb, got, err)
		}
		if n, _, realloc := second.ReopenCounts(); n != 1 || realloc != 0 {
			t.Errorf("ReopenCounts = %d reopened, %d reallocated; want 1, 0", n, realloc)
		}
	})
}

func TestBoundAdoptable(t *testing.T) {
	ap := netip.MustParseAddrPort
	plan := []netip.AddrPort{ap("10.96.0.10:80"), ap("0.0.0.0:30080")}
	p := New(Config{ListenPlan: func(*service.Port) []netip.AddrPort { return plan }}, Deps{})
	port := &service.Port{Name: webHTTP, Protocol: service.TCP, Port: 80, NodePort: 30080, ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}}
	p.paths.restart.seeded[webHTTP] = true
	for _, tc := range []struct {
		name   string
		a      *activePort
		protoc service.Protocol
		want   bool
	}{
		{"same_addresses_in_another_order", &activePort{port: &service.Port{Protocol: service.TCP}, listen: []netip.AddrPort{plan[1], plan[0]}}, service.TCP, true},
		{"an_address_more", &activePort{port: &service.Port{Protocol: service.TCP}, listen: append(slices.Clone(plan), ap("10.96.0.11:80"))}, service.TCP, false},
		{"an_address_less", &activePort{port: &service.Port{Protocol: service.TCP}, listen: plan[:1]}, service.TCP, false},
		{"other_protocol", &activePort{port: &service.Port{Protocol: service.UDP}, listen: plan}, service.TCP, false},
		{"was_split_now_is_not", &activePort{port: &service.Port{Protocol: service.TCP}, listen: plan[:1], split: true,
			ext: &activePort{listen: plan[1:]}}, service.TCP, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := p.paths.adoptable(tc.a, port); got != tc.want {
				t.Errorf("adoptable = %v, want %v", got, tc.want)
			}
		})
	}
}
