package daemon

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestKernelEndpointMetricLabels: the KUBE-SEP counters are exported with the label every other
// per-port series uses, service_port (not service), with the protocol and endpoint, and the
// DNAT rule's counters as values. Address plan: node 192.168.1.10, ns/web:http TCP 10.96.0.10:80
// on the kernel path, endpoint 10.244.1.5:8080. The e2e suite checks the same after real traffic
// (e2e/kernelpath_udp_switch_test.go).
func TestKernelEndpointMetricLabels(t *testing.T) {
	fake := iptables.NewFake()
	rules := iptables.New(iptables.Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("192.168.1.10")},
		KernelPath: true}, fake)
	name := service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}
	ep := netip.MustParseAddrPort("10.244.1.5:8080")
	spec := portal.Spec{Name: name, Protocol: service.TCP, Port: 80, ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		Kernel: &portal.KernelPath{Cluster: []netip.AddrPort{ep}, AnyEndpoints: true}}
	if err := rules.Sync(t.Context(), []portal.Spec{spec}); err != nil {
		t.Fatal(err)
	}
	sep := kernel.EndpointChain(name, service.TCP, ep.String())
	fake.Counters = map[string][2]uint64{
		sep + ` -p tcp -m comment --comment "ns/web:http" -m tcp -j DNAT --to-destination 10.244.1.5:8080`: {7, 420},
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(portalCollector(rules))
	want := `
# HELP kube_portal_proxy_kernel_endpoint_packets_total Packets through the DNAT rule of a kernel-path endpoint's KUBE-SEP chain: the nat table sees the first packet of each connection (UDP flow) only, so this counts new connections.
# TYPE kube_portal_proxy_kernel_endpoint_packets_total counter
kube_portal_proxy_kernel_endpoint_packets_total{endpoint="10.244.1.5:8080",protocol="TCP",service_port="ns/web:http"} 7
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kube_portal_proxy_kernel_endpoint_packets_total"); err != nil {
		t.Error(err)
	}
}
