package metrics

import (
	"iter"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ports is a TrafficSource of fixed snapshots.
type ports []PortTraffic

func (p ports) Traffic() iter.Seq[PortTraffic] { return slices.Values(p) }

func webPort(port string) service.ServicePortName {
	return service.ServicePortName{Namespace: "ns", Name: "web", Port: port}
}

func TestTrafficCollectorSeries(t *testing.T) {
	tests := []struct {
		name  string
		ports ports
		// names are the series compared; want is their exposition.
		names []string
		want  string
	}{
		{
			name: "tcp_counters_and_the_balancer's_endpoints",
			ports: ports{{Name: webPort("http"), Protocol: service.TCP, Balanced: true, Endpoints: 2, Observed: true,
				Stats: flow.Stats{Active: 1, Total: 3, BytesToEndpoint: 10, BytesToClient: 20, NoEndpoint: 4}}},
			names: []string{"kube_portal_proxy_endpoints", "kube_portal_proxy_tcp_connections_active", "kube_portal_proxy_tcp_bytes_total", "kube_portal_proxy_no_endpoint_rejects_total"},
			want: `
# HELP kube_portal_proxy_endpoints Endpoints the balancer uses for the service port.
# TYPE kube_portal_proxy_endpoints gauge
kube_portal_proxy_endpoints{service_port="ns/web:http"} 2
# HELP kube_portal_proxy_no_endpoint_rejects_total New connections (reset) or datagrams (dropped) with no endpoint to go to.
# TYPE kube_portal_proxy_no_endpoint_rejects_total counter
kube_portal_proxy_no_endpoint_rejects_total{protocol="tcp",service_port="ns/web:http"} 4
# HELP kube_portal_proxy_tcp_bytes_total Bytes proxied over TCP; direction is to_endpoint (client to pod) or to_client.
# TYPE kube_portal_proxy_tcp_bytes_total counter
kube_portal_proxy_tcp_bytes_total{direction="to_client",service_port="ns/web:http"} 20
kube_portal_proxy_tcp_bytes_total{direction="to_endpoint",service_port="ns/web:http"} 10
# HELP kube_portal_proxy_tcp_connections_active Open proxied TCP connections.
# TYPE kube_portal_proxy_tcp_connections_active gauge
kube_portal_proxy_tcp_connections_active{service_port="ns/web:http"} 1
`,
		},
		{
			name: "udp_sessions_by_event",
			ports: ports{{Name: webPort("dns"), Protocol: service.UDP, Observed: true, Stats: flow.Stats{Total: 5,
				Ended: func() (e [flow.NumEndReasons]uint64) {
					e[flow.IdleTimeout], e[flow.EndpointRemoved], e[flow.Shutdown] = 2, 1, 1
					return e
				}()}}},
			names: []string{"kube_portal_proxy_udp_sessions_total"},
			want: `
# HELP kube_portal_proxy_udp_sessions_total Ended or created UDP sessions; event is created, expired, evicted, refused or closed.
# TYPE kube_portal_proxy_udp_sessions_total counter
kube_portal_proxy_udp_sessions_total{event="closed",service_port="ns/web:dns"} 2
kube_portal_proxy_udp_sessions_total{event="created",service_port="ns/web:dns"} 5
kube_portal_proxy_udp_sessions_total{event="evicted",service_port="ns/web:dns"} 0
kube_portal_proxy_udp_sessions_total{event="expired",service_port="ns/web:dns"} 2
kube_portal_proxy_udp_sessions_total{event="refused",service_port="ns/web:dns"} 0
`,
		},
		{
			name: "outlier_drain_and_hold_series_only_where_on",
			ports: ports{
				{Name: webPort("on"), Protocol: service.TCP, Observed: true, Outlier: true, Ejections: 3, Ejected: 1,
					Drain: true, Drained: 7, Holds: true, Stats: flow.Stats{Held: 2}},
				{Name: webPort("off"), Protocol: service.TCP, Observed: true},
			},
			names: []string{"kube_portal_proxy_outlier_ejections_total", "kube_portal_proxy_outlier_ejected_endpoints",
				"kube_portal_proxy_drain_closed_total", "kube_portal_proxy_tcp_held_connections"},
			want: `
# HELP kube_portal_proxy_drain_closed_total TCP connections or UDP sessions closed by their endpoint's drain deadline (service ports with a drain-timeout).
# TYPE kube_portal_proxy_drain_closed_total counter
kube_portal_proxy_drain_closed_total{protocol="tcp",service_port="ns/web:on"} 7
# HELP kube_portal_proxy_outlier_ejected_endpoints Endpoints out of rotation now by outlier detection (service ports with it on).
# TYPE kube_portal_proxy_outlier_ejected_endpoints gauge
kube_portal_proxy_outlier_ejected_endpoints{service_port="ns/web:on"} 1
# HELP kube_portal_proxy_outlier_ejections_total Endpoints taken out of rotation by outlier detection (service ports with it on).
# TYPE kube_portal_proxy_outlier_ejections_total counter
kube_portal_proxy_outlier_ejections_total{service_port="ns/web:on"} 3
# HELP kube_portal_proxy_tcp_held_connections TCP connections held now for want of an endpoint (service ports with a hold-timeout).
# TYPE kube_portal_proxy_tcp_held_connections gauge
kube_portal_proxy_tcp_held_connections{service_port="ns/web:on"} 2
`,
		},
		{
			name: "transparent_dials_only_where_the_port_is_transparent",
			ports: ports{
				{Name: webPort("on"), Protocol: service.UDP, Observed: true, Transparent: true, TransparentDials: 5, TransparentFallbacks: 1},
				{Name: webPort("off"), Protocol: service.TCP, Observed: true},
			},
			names: []string{"kube_portal_proxy_transparent_dials_total"},
			want: `
# HELP kube_portal_proxy_transparent_dials_total Endpoint connections or UDP sessions of service ports in the transparent source mode, by result: transparent (dialed from the client's address and port) or fallback (the policy wanted it, the client's address could not be taken: dialed from the node's). Flows the policy keeps on the node's address (the replies would not pass this node, a host-network client or endpoint, hairpin) are not counted.
# TYPE kube_portal_proxy_transparent_dials_total counter
kube_portal_proxy_transparent_dials_total{protocol="udp",result="fallback",service_port="ns/web:on"} 1
kube_portal_proxy_transparent_dials_total{protocol="udp",result="transparent",service_port="ns/web:on"} 5
`,
		},
		{
			name:  "a_socket_without_counters_has_no_traffic_series",
			ports: ports{{Name: webPort("http"), Protocol: service.TCP, Drain: true}},
			want:  "",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := NewTrafficCollector(tc.ports)
			if tc.names == nil {
				if n := testutil.CollectAndCount(c); n != 0 {
					t.Errorf("%d series, want none", n)
				}
				return
			}
			if err := testutil.CollectAndCompare(c, strings.NewReader(tc.want), tc.names...); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestObserveProgrammingIgnoresChangesFromTheFuture(t *testing.T) {
	m := New()
	reg := prometheus.NewRegistry()
	if err := m.Register(reg); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1_700_000_000, 0)
	m.ObserveProgramming("IPv4", now, now.Add(-2*time.Second))
	m.ObserveProgramming("IPv4", now, now.Add(time.Second)) // a clock step: not a latency
	// Only the count and sum are compared: the bucket lines are kube-proxy's long list.
	got, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range got {
		if mf.GetName() == "kubeproxy_network_programming_duration_seconds" {
			h := mf.GetMetric()[0].GetHistogram()
			if h.GetSampleCount() != 1 || h.GetSampleSum() != 2 {
				t.Errorf("programming latency: %d samples summing to %v, want one of 2s", h.GetSampleCount(), h.GetSampleSum())
			}
			return
		}
	}
	t.Error("kubeproxy_network_programming_duration_seconds not registered")
}
