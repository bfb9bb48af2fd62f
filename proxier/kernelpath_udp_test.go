package proxier

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestUDPToKernelClearsOnlyRedirectedEntries: a UDP port that moves from the proxy socket to the
// kernel path has its conntrack entries cleared after the sync that put the kernel chains in, and
// only those the portal rules redirected to its old proxy port. Clearing all of them also
// deleted the entries the new DNAT rules had made for datagrams in flight, and the endpoint's
// answers were lost (a lost DNS answer right after the switch in the chaos soak, issue 34).
// Address plan: service 10.96.0.53:53/UDP, endpoint 10.244.1.1:5353.
func TestUDPToKernelClearsOnlyRedirectedEntries(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.synced()
	slice := makeSlice("kube-system", "dns", "a", discovery.AddressTypeIPv4,
		[]discovery.EndpointPort{slicePortOf("dns", v1.ProtocolUDP, 5353)}, sliceEP{addr: "10.244.1.1"})
	e.p.OnEndpointSliceAdd(slice)
	e.p.OnServiceAdd(makeService("kube-system", "dns", "10.96.0.53", nil, udpPort("dns", 53)))
	e.sync()
	dnsName := service.ServicePortName{Namespace: "kube-system", Name: "dns", Port: "dns"}
	spec, ok := e.specOf(dnsName)
	if !ok || spec.ProxyPort == 0 {
		t.Fatalf("on the proxy path: spec %+v, want a proxy port", spec)
	}
	e.conntrack.Reset()

	e.p.OnServiceUpdate(nil, makeService("kube-system", "dns", "10.96.0.53", withDataPath("kernel"), udpPort("dns", 53)))
	e.sync()
	if got, want := e.conntrack.Dump(), fmt.Sprintf("udp 10.96.0.53:53 via [%d]", spec.ProxyPort); got != want {
		t.Errorf("after the move to the kernel path conntrack cleared %q, want %q", got, want)
	}
}
