package proxier

// Address plan: cluster IPs 10.96.0.0/16 and fd00:96::/64, external 203.0.113.0/24, LB 198.51.100.0/24,
// endpoints 10.244.x.y / fd00:244::x. Conversion only; no traffic.

import (
	"errors"
	"fmt"
	"net/netip"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func ptr[T any](v T) *T { return &v }

func makeService(ns, name, clusterIP string, mutate func(*v1.Service), ports ...v1.ServicePort) *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       v1.ServiceSpec{ClusterIP: clusterIP, ClusterIPs: []string{clusterIP}, Type: v1.ServiceTypeClusterIP, Ports: ports},
	}
	if mutate != nil {
		mutate(svc)
	}
	return svc
}

func tcpPort(name string, port int32) v1.ServicePort {
	return v1.ServicePort{Name: name, Port: port, Protocol: v1.ProtocolTCP}
}

func udpPort(name string, port int32) v1.ServicePort {
	return v1.ServicePort{Name: name, Port: port, Protocol: v1.ProtocolUDP}
}

var addrs = testenv.Addrs

func TestConvertService(t *testing.T) {
	tests := []struct {
		name    string
		svc     *v1.Service
		want    []string // Port rendered by describePort
		wantErr []string
	}{
		{
			name: "cluster_ip_multi_port",
			svc:  makeService("default", "web", "10.96.0.10", nil, tcpPort("http", 80), udpPort("dns", 53)),
			want: []string{
				"default/web:http TCP 80 np=0 cips=[10.96.0.10] ext=[] lb=[] aff={false 0s}",
				"default/web:dns UDP 53 np=0 cips=[10.96.0.10] ext=[] lb=[] aff={false 0s}",
			},
		},
		{
			name: "dual_stack_external_lb_nodeport_affinity",
			svc: makeService("ns", "lb", "10.96.0.11", func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"10.96.0.11", "fd00:96::11"}
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.ExternalIPs = []string{"203.0.113.7", "bogus", "203.0.113.7"}
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr(int32(60))}}
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "198.51.100.1"}, {Hostname: "lb.example"}}
				s.Spec.Ports[0].NodePort = 30080
			}, tcpPort("", 80)),
			want: []string{"ns/lb TCP 80 np=30080 cips=[10.96.0.11 fd00:96::11] ext=[203.0.113.7] lb=[198.51.100.1] aff={true 1m0s}"},
		},
		{
			name: "clientip_default_timeout",
			svc: makeService("ns", "a", "10.96.0.12", func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
			}, tcpPort("", 80)),
			want: []string{"ns/a TCP 80 np=0 cips=[10.96.0.12] ext=[] lb=[] aff={true 3h0m0s}"},
		},
		{name: "headless_skipped", svc: makeService("ns", "h", "None", nil, tcpPort("", 80))},
		{name: "no_cluster_ip_skipped", svc: makeService("ns", "h", "", nil, tcpPort("", 80))},
		{name: "external_name_skipped", svc: makeService("ns", "x", "10.96.0.13", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeExternalName
		}, tcpPort("", 80))},
		{name: "other_proxy_skipped", svc: makeService("ns", "o", "10.96.0.14", func(s *v1.Service) {
			s.Labels = map[string]string{LabelServiceProxyName: "other"}
		}, tcpPort("", 80))},
		{
			name:    "sctp_rejected_others_kept",
			svc:     makeService("ns", "s", "10.96.0.15", nil, v1.ServicePort{Name: "sctp", Port: 9, Protocol: v1.ProtocolSCTP}, tcpPort("t", 9)),
			want:    []string{"ns/s:t TCP 9 np=0 cips=[10.96.0.15] ext=[] lb=[] aff={false 0s}"},
			wantErr: []string{"service port ns/s:sctp: SCTP: protocol not supported by a userspace proxy"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ports, errs := convertService(tc.svc)
			var got []string
			for _, p := range ports {
				got = append(got, describePort(p))
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("ports (-want +got):\n- %q\n+ %q", tc.want, got)
			}
			var gotErr []string
			for _, e := range errs {
				gotErr = append(gotErr, e.Error())
			}
			if fmt.Sprint(gotErr) != fmt.Sprint(tc.wantErr) {
				t.Errorf("errors (-want +got):\n- %q\n+ %q", tc.wantErr, gotErr)
			}
			for _, e := range errs {
				if tc.name == "sctp_rejected_others_kept" && !errors.Is(e, ErrUnsupportedProtocol) {
					t.Errorf("error %v does not wrap ErrUnsupportedProtocol", e)
				}
			}
		})
	}
}

func describePort(p *service.Port) string {
	return fmt.Sprintf("%s %s %d np=%d cips=%v ext=%v lb=%v aff={%v %v}", p.Name, p.Protocol, p.Port, p.NodePort,
		p.ClusterIPs, orEmpty(p.ExternalIPs), orEmpty(p.LoadBalancerIPs), p.Affinity.ClientIP, p.Affinity.Timeout)
}

func orEmpty(a []netip.Addr) []netip.Addr {
	if a == nil {
		return []netip.Addr{}
	}
	return a
}

type sliceEP struct {
	addr                        string
	ready, serving, terminating *bool
}

func makeSlice(ns, svc, name string, family discovery.AddressType, ports []discovery.EndpointPort, eps ...sliceEP) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discovery.LabelServiceName: svc}},
		AddressType: family,
		Ports:       ports,
	}
	for _, e := range eps {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{e.addr},
			Conditions: discovery.EndpointConditions{Ready: e.ready, Serving: e.serving, Terminating: e.terminating}})
	}
	return s
}

// udpSlice is an IPv4 EndpointSlice of ns/svc with one UDP port, named as the service's, ready
// endpoints at addrs.
func udpSlice(ns, svc, slice string, port int32, addrs ...string) *discovery.EndpointSlice {
	var eps []sliceEP
	for _, a := range addrs {
		eps = append(eps, sliceEP{addr: a})
	}
	return makeSlice(ns, svc, slice, discovery.AddressTypeIPv4, []discovery.EndpointPort{slicePortOf(svc, v1.ProtocolUDP, port)}, eps...)
}

func slicePortOf(name string, proto v1.Protocol, port int32) discovery.EndpointPort {
	return discovery.EndpointPort{Name: ptr(name), Protocol: ptr(proto), Port: ptr(port)}
}

func TestEndpointsFor(t *testing.T) {
	yes, no := ptr(true), ptr(false)
	httpPort := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}, Protocol: service.TCP,
		ClusterIPs: addrs("10.96.0.10")}
	dual := *httpPort
	dual.ClusterIPs = addrs("10.96.0.10", "fd00:96::10")
	httpTCP := []discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, 8080), slicePortOf("metrics", v1.ProtocolTCP, 9090)}
	tests := []struct {
		name   string
		port   *service.Port
		slices []*discovery.EndpointSlice
		want   string
	}{
		{
			name:   "ready_only_and_nil_means_ready",
			port:   httpPort,
			slices: []*discovery.EndpointSlice{makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, httpTCP, sliceEP{addr: "10.244.1.2"}, sliceEP{addr: "10.244.1.3", ready: no}, sliceEP{addr: "10.244.1.1", ready: yes})},
			want:   "[10.244.1.1:8080 10.244.1.2:8080]",
		},
		{
			name: "terminating_fallback_only_when_none_ready",
			port: httpPort,
			slices: []*discovery.EndpointSlice{makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, httpTCP,
				sliceEP{addr: "10.244.1.4", ready: no, serving: yes, terminating: yes},
				sliceEP{addr: "10.244.1.5", ready: no, serving: no, terminating: yes})},
			want: "[10.244.1.4:8080]",
		},
		{
			name: "terminating_ignored_when_ready_exists",
			port: httpPort,
			slices: []*discovery.EndpointSlice{makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, httpTCP,
				sliceEP{addr: "10.244.1.4", ready: no, serving: yes, terminating: yes}, sliceEP{addr: "10.244.1.6"})},
			want: "[10.244.1.6:8080]",
		},
		{
			name: "merge_slices_dedupe_skip_other_family_and_protocol",
			port: httpPort,
			slices: []*discovery.EndpointSlice{
				makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, httpTCP, sliceEP{addr: "10.244.1.2"}),
				makeSlice("ns", "web", "b", discovery.AddressTypeIPv4, httpTCP, sliceEP{addr: "10.244.2.2"}, sliceEP{addr: "10.244.1.2"}),
				makeSlice("ns", "web", "c", discovery.AddressTypeIPv6, httpTCP, sliceEP{addr: "fd00:244::2"}),
				makeSlice("ns", "web", "d", discovery.AddressTypeIPv4, []discovery.EndpointPort{slicePortOf("http", v1.ProtocolUDP, 8080)}, sliceEP{addr: "10.244.3.3"}),
				makeSlice("ns", "web", "e", discovery.AddressTypeFQDN, httpTCP, sliceEP{addr: "example.com"}),
			},
			want: "[10.244.1.2:8080 10.244.2.2:8080]",
		},
		{
			name: "dual_stack_uses_both_families",
			port: &dual,
			slices: []*discovery.EndpointSlice{
				makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, httpTCP, sliceEP{addr: "10.244.1.2"}),
				makeSlice("ns", "web", "c", discovery.AddressTypeIPv6, httpTCP, sliceEP{addr: "fd00:244::2"}),
			},
			want: "[10.244.1.2:8080 [fd00:244::2]:8080]",
		},
		{
			name:   "unnamed_port_does_not_match_named",
			port:   &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web"}, Protocol: service.TCP, ClusterIPs: addrs("10.96.0.10")},
			slices: []*discovery.EndpointSlice{makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, httpTCP, sliceEP{addr: "10.244.1.2"})},
			want:   "[]",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var slim []*slimSlice
			for _, s := range tc.slices {
				slim = append(slim, convertSlice(s))
			}
			got := fmt.Sprint(usableEndpoints(endpointsFor(tc.port, slim)))
			if got != tc.want {
				t.Errorf("endpoints (-want +got):\n- %s\n+ %s", tc.want, got)
			}
		})
	}
}

func TestServiceChangeTracker(t *testing.T) {
	// The legacy TestOnServiceAddChangeMap table: how add/update/delete events coalesce.
	a := []*service.Port{{Name: service.ServicePortName{Namespace: "ns", Name: "s"}, Protocol: service.TCP, Port: 80}}
	b := []*service.Port{{Name: service.ServicePortName{Namespace: "ns", Name: "s"}, Protocol: service.TCP, Port: 81}}
	c := []*service.Port{{Name: service.ServicePortName{Namespace: "ns", Name: "s"}, Protocol: service.TCP, Port: 82, Affinity: service.Affinity{ClientIP: true, Timeout: time.Minute}}}
	name := service.NamespacedName{Namespace: "ns", Name: "s"}
	type event struct{ prev, cur []*service.Port }
	tests := []struct {
		name       string
		events     []event
		wantChange bool
		wantPrev   []*service.Port
		wantCur    []*service.Port
	}{
		{"add", []event{{nil, a}}, true, nil, a},
		{"add_then_update_is_add", []event{{nil, a}, {a, b}}, true, nil, b},
		{"add_then_delete_is_nothing", []event{{nil, a}, {a, nil}}, false, nil, nil},
		{"update_update_keeps_oldest_previous", []event{{a, b}, {b, c}}, true, a, c},
		{"update_then_delete_is_delete_of_oldest", []event{{a, b}, {b, nil}}, true, a, nil},
		{"delete_then_add_is_update", []event{{a, nil}, {nil, b}}, true, a, b},
		{"update_back_to_original_is_nothing", []event{{a, b}, {b, a}}, false, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := newServiceChangeTracker()
			for _, e := range tc.events {
				tr.update(name, e.prev, e.cur)
			}
			got := tr.take()
			ch, ok := got[name]
			if ok != tc.wantChange {
				t.Fatalf("pending change = %v, want %v", ok, tc.wantChange)
			}
			if !ok {
				return
			}
			if !portsEqual(ch.previous, tc.wantPrev) || !portsEqual(ch.current, tc.wantCur) {
				t.Errorf("change (-want +got):\n- prev=%v cur=%v\n+ prev=%v cur=%v", tc.wantPrev, tc.wantCur, ch.previous, ch.current)
			}
			if n := len(tr.take()); n != 0 {
				t.Errorf("take did not start a new batch: %d pending", n)
			}
		})
	}
}

func TestConvertServiceTrafficFields(t *testing.T) {
	local := ptr(v1.ServiceInternalTrafficPolicyLocal)
	tests := []struct {
		name    string
		mutate  func(*v1.Service)
		want    string // rendered by describeTraffic
		wantErr []string
	}{
		{
			name: "defaults",
			want: "etp=false itp=false hc=0 ranges=[] td=",
		},
		{
			name: "external_local_on_node_port",
			mutate: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 32000 // only a LoadBalancer gets one
			},
			want: "etp=true itp=false hc=0 ranges=[] td=",
		},
		{
			name: "external_local_meaningless_on_plain_cluster_ip",
			mutate: func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			},
			want: "etp=false itp=false hc=0 ranges=[] td=",
		},
		{
			name: "external_local_on_cluster_ip_with_external_ips",
			mutate: func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"203.0.113.9"}
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			},
			want: "etp=true itp=false hc=0 ranges=[] td=",
		},
		{
			name: "load_balancer_local_has_health_check_node_port",
			mutate: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 32000
				s.Spec.InternalTrafficPolicy = local
			},
			want: "etp=true itp=true hc=32000 ranges=[] td=",
		},
		{
			name: "load_balancer_local_without_health_check_node_port_is_reported",
			mutate: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			},
			want:    "etp=true itp=false hc=0 ranges=[] td=",
			wantErr: []string{"service ns/t: healthCheckNodePort 0: load balancers cannot check this node's endpoints"},
		},
		{
			name: "source_ranges_trimmed_masked_deduplicated_bad_one_skipped",
			mutate: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.LoadBalancerSourceRanges = []string{" 192.0.2.0/24", "10.1.2.3/8", "bogus", "2001:db8::/32 ", "10.0.0.0/8", "10.0.0.0/33"}
			},
			want: "etp=false itp=false hc=0 ranges=[192.0.2.0/24 10.0.0.0/8 2001:db8::/32] td=",
			wantErr: []string{
				`service ns/t: loadBalancerSourceRanges[2] skipped: netip.ParsePrefix("bogus"): no '/'`,
				`service ns/t: loadBalancerSourceRanges[5] skipped: netip.ParsePrefix("10.0.0.0/33"): prefix length out of range`,
			},
		},
		{
			name: "source_ranges_annotation_not_read_as_kube_proxy",
			mutate: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Annotations = map[string]string{"service.beta.kubernetes.io/load-balancer-source-ranges": "192.0.2.0/24"}
			},
			want: "etp=false itp=false hc=0 ranges=[] td=",
		},
		{
			name:   "traffic_distribution_verbatim",
			mutate: func(s *v1.Service) { s.Spec.TrafficDistribution = ptr(v1.ServiceTrafficDistributionPreferSameNode) },
			want:   "etp=false itp=false hc=0 ranges=[] td=PreferSameNode",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			svc := makeService("ns", "t", "10.96.0.20", tc.mutate, tcpPort("a", 80), udpPort("b", 53))
			ports, errs := convertService(svc)
			if len(ports) != 2 {
				t.Fatalf("got %d ports, want both kept", len(ports))
			}
			for _, p := range ports {
				if got := describeTraffic(p); got != tc.want {
					t.Errorf("port %s (-want +got):\n- %s\n+ %s", p.Name, tc.want, got)
				}
			}
			var gotErr []string
			for _, e := range errs {
				gotErr = append(gotErr, e.Error())
			}
			if fmt.Sprint(gotErr) != fmt.Sprint(tc.wantErr) {
				t.Errorf("errors (-want +got):\n- %q\n+ %q", tc.wantErr, gotErr)
			}
		})
	}
}

func describeTraffic(p *service.Port) string {
	ranges := p.LoadBalancerSourceRanges
	if ranges == nil {
		ranges = []netip.Prefix{}
	}
	return fmt.Sprintf("etp=%v itp=%v hc=%d ranges=%v td=%s", p.ExternalLocal, p.InternalLocal, p.HealthCheckNodePort, ranges, p.TrafficDistribution)
}

func TestConvertSliceTopology(t *testing.T) {
	s := makeSlice("ns", "web", "a", discovery.AddressTypeIPv4, []discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, 8080)})
	s.Endpoints = []discovery.Endpoint{
		{
			Addresses: []string{"10.244.1.2"}, NodeName: ptr("node-a"), Zone: ptr("zone-a"),
			Hints: &discovery.EndpointHints{
				ForZones: []discovery.ForZone{{Name: "zone-b"}, {Name: "zone-a"}, {Name: "zone-b"}, {Name: ""}},
				ForNodes: []discovery.ForNode{{Name: "node-a"}},
			},
			TargetRef: &v1.ObjectReference{Kind: "Pod", Name: "web-0"}, // namespace defaults to the slice's
		},
		{
			Addresses: []string{"10.244.2.2"}, Hints: &discovery.EndpointHints{},
			TargetRef: &v1.ObjectReference{Kind: "Pod", Namespace: "other", Name: "web-1"},
		},
	}
	got := convertSlice(s).endpoints
	want := []service.Endpoint{
		{Addr: netip.MustParseAddrPort("10.244.1.2:0"), Ready: true, Serving: true, NodeName: "node-a", Zone: "zone-a",
			ZoneHints: []string{"zone-a", "zone-b"}, NodeHints: []string{"node-a"},
			TargetRef: service.NamespacedName{Namespace: "ns", Name: "web-0"}},
		{Addr: netip.MustParseAddrPort("10.244.2.2:0"), Ready: true, Serving: true,
			TargetRef: service.NamespacedName{Namespace: "other", Name: "web-1"}},
	}
	if len(got) != len(want) {
		t.Fatalf("endpoints (-want +got):\n- %+v\n+ %+v", want, got)
	}
	for i := range want {
		if !got[i].Equal(&want[i]) {
			t.Errorf("endpoint %d (-want +got):\n- %+v\n+ %+v", i, want[i], got[i])
		}
	}

	// The hints reach every port of the service through endpointsFor.
	port := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}, Protocol: service.TCP,
		ClusterIPs: addrs("10.96.0.10")}
	eps := endpointsFor(port, []*slimSlice{convertSlice(s)})
	if len(eps) != 2 || eps[0].Addr.Port() != 8080 || !eps[0].HasZoneHint("zone-a") || !eps[0].HasNodeHint("node-a") {
		t.Errorf("endpointsFor lost the port or hints: %+v", eps)
	}
}
