package proxier

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestBindModeWithRealSockets runs bind mode's refusal and source-range check with real loopback
// sockets: the "cluster IP" 127.0.0.50 and "load-balancer IP" 127.0.0.51 are loopback addresses,
// so the sockets listen on them as bind mode listens on service IPs. The endpoint is an echo
// server on 127.0.0.1; clients dial from 127.0.0.5 (inside the source range) and 127.0.0.6.
func TestBindModeWithRealSockets(t *testing.T) {
	echo := echoTCP(t)
	// A port free on 127.0.0.50, for the service port.
	port := testenv.FreeTCPPort(t, "127.0.0.50")
	cluster, lb := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.50"), port), netip.AddrPortFrom(netip.MustParseAddr("127.0.0.51"), port)

	p := New(Config{MinSyncPeriod: time.Second, SyncPeriod: time.Minute, ListenPlan: func(sp *service.Port) []netip.AddrPort {
		return []netip.AddrPort{cluster, lb}
	}}, Deps{Balancer: loadbalancer.New(clock.RealClock{}), Portals: &recordingPortals{}, Sockets: RealSockets(SocketConfig{})})
	ctx, cancel := context.WithCancel(context.Background())
	p.paths.runCtx = ctx
	t.Cleanup(func() { cancel(); p.shutdown() })
	collector := metrics.NewTrafficCollector(p)
	sync := func() {
		t.Helper()
		if err := p.sync(ctx); err != nil {
			t.Fatal(err)
		}
	}
	dial := func(from string, to netip.AddrPort) (string, error) {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp4", to.String())
		if err != nil {
			return "", err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("ping")); err != nil {
			return "", err
		}
		buf := make([]byte, 4)
		_, err = io.ReadFull(c, buf)
		return string(buf), err
	}

	p.OnServicesSynced()
	p.OnEndpointSlicesSynced()
	p.OnServiceAdd(makeService("ns", "web", "127.0.0.50", func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.Ports[0].NodePort = 30080
		s.Spec.LoadBalancerSourceRanges = []string{"127.0.0.5/32"}
		s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "127.0.0.51"}}
	}, tcpPort("http", int32(port))))
	sync()

	t.Run("no_endpoints_refused_by_the_kernel", func(t *testing.T) {
		for _, to := range []netip.AddrPort{cluster, lb} {
			if got, err := dial("127.0.0.5", to); !errors.Is(err, syscall.ECONNREFUSED) {
				t.Errorf("%s without endpoints: %q, %v; want ECONNREFUSED", to, got, err)
			}
		}
		if v := testutil.ToFloat64(p.deps.Metrics.RefusedPorts.WithLabelValues("cluster")); v != 1 {
			t.Errorf("refused cluster service ports = %v, want 1", v)
		}
	})

	p.OnEndpointSliceAdd(makeSlice("ns", "web", "a", discovery.AddressTypeIPv4,
		[]discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, int32(echo.Port()))}, sliceEP{addr: "127.0.0.1"}))
	sync()

	t.Run("served_once_an_endpoint_appears_with_source_ranges_on_the_LB_IP", func(t *testing.T) {
		for _, c := range []struct {
			from string
			to   netip.AddrPort
		}{{"127.0.0.5", cluster}, {"127.0.0.6", cluster}, {"127.0.0.5", lb}} {
			if got, err := dial(c.from, c.to); err != nil || got != "ping" {
				t.Errorf("from %s to %s: %q, %v; want the echo", c.from, c.to, got, err)
			}
		}
		if got, err := dial("127.0.0.6", lb); !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("from 127.0.0.6 (outside the range) to %s: %q, %v; want a reset", lb, got, err)
		}
		if v := testutil.ToFloat64(p.deps.Metrics.RefusedPorts.WithLabelValues("cluster")); v != 0 {
			t.Errorf("refused cluster service ports = %v, want 0", v)
		}
		want := `# HELP kube_portal_proxy_source_range_drops_total New connections (reset) or datagrams (dropped) from clients outside loadBalancerSourceRanges, checked by the socket in bind mode (iptables mode drops them in the kernel, uncounted here).
# TYPE kube_portal_proxy_source_range_drops_total counter
kube_portal_proxy_source_range_drops_total{protocol="tcp",service_port="ns/web:http"} 1
`
		if err := testutil.CollectAndCompare(collector, strings.NewReader(want), "kube_portal_proxy_source_range_drops_total"); err != nil {
			t.Error(err)
		}
	})
}
