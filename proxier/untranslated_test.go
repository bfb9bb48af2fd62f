package proxier

// Address plan: UDP service kube-system/dns at cluster IP 10.96.0.53:53, node port 30053, pods
// 10.244.1.5 and 10.244.1.6 (port 5353); TCP service ns/web at 10.96.0.10:80.

import (
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// TestSyncClearsUntranslatedUDPWhenAPortBeginsToSteer: the untranslated conntrack entries of a
// UDP port (made while no rule steered its traffic) are cleared after the sync that made it steer
// a class of traffic it did not steer before, and at no other sync.
func TestSyncClearsUntranslatedWhenAPortBeginsToSteer(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	dns := makeService("kube-system", "dns", "10.96.0.53", func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30053
	}, udpPort("dns", 53))
	slice := func(addrs ...string) *discovery.EndpointSlice {
		return udpSlice("kube-system", "dns", "dns-a", 5353, addrs...)
	}
	const cleared = "10.96.0.53:53 nodeport 30053"
	const web = "10.96.0.10:80" // a TCP port clears too: an early SYN pins its source port as a datagram does
	steps := []struct {
		name string
		do   func()
		want string // the ClearUntranslated calls so far, one a line
	}{
		{"new_port_without_endpoints_refuses_clears_nothing", func() { e.p.OnServiceAdd(dns) }, ""},
		{"a_TCP_port_with_endpoints_clears", func() {
			e.p.OnServiceAdd(webService(nil))
			e.p.OnEndpointSliceAdd(webSlice("web-a", 8080, "10.244.1.9"))
		}, web},
		{"endpoints_appear_clears", func() { e.p.OnEndpointSliceAdd(slice("10.244.1.5")) }, web + "\n" + cleared},
		{"more_endpoints_clear_nothing", func() { e.p.OnEndpointSliceUpdate(slice("10.244.1.5"), slice("10.244.1.5", "10.244.1.6")) }, web + "\n" + cleared},
		{"a_sync_with_no_change_clears_nothing", func() {}, web + "\n" + cleared},
		{"endpoints_gone_refuses_clears_nothing", func() { e.p.OnEndpointSliceUpdate(slice("10.244.1.5", "10.244.1.6"), slice()) }, web + "\n" + cleared},
		{"endpoints_back_clears_again", func() { e.p.OnEndpointSliceUpdate(slice(), slice("10.244.1.6")) }, web + "\n" + cleared + "\n" + cleared},
		{"port_removed", func() { e.p.OnServiceDelete(dns) }, web + "\n" + cleared + "\n" + cleared},
		{"port_back_with_its_endpoints_clears", func() { e.p.OnServiceAdd(dns) }, web + "\n" + cleared + "\n" + cleared + "\n" + cleared},
	}
	for _, s := range steps {
		s.do()
		e.sync()
		if got := e.conntrack.DumpUntranslated(); got != s.want {
			t.Fatalf("%s: ClearUntranslated calls (-want +got):\n-%q\n+%q", s.name, s.want, got)
		}
	}
	if _, tcp := e.p.paths.steered[webHTTP]; !tcp || len(e.p.paths.steered) != 2 {
		t.Errorf("tracked ports = %v, want kube-system/dns:dns and %v", e.p.paths.steered, webHTTP)
	}
}

// TestSyncClearsUntranslatedOncePerSync: ports that begin to steer in the same sync (a start with
// many UDP services) share one ClearUntranslated, so the table is walked once.
func TestSyncClearsUntranslatedOncePerSync(t *testing.T) {
	e := newFakeEnv(t, nil)
	for ns, ip := range map[string]string{"a": "10.96.0.51", "b": "10.96.0.52", "c": "10.96.0.53"} {
		e.p.OnServiceAdd(makeService(ns, "dns", ip, nil, udpPort("dns", 53)))
		e.p.OnEndpointSliceAdd(makeSlice(ns, "dns", "dns-a", discovery.AddressTypeIPv4,
			[]discovery.EndpointPort{slicePortOf("dns", v1.ProtocolUDP, 5353)}, sliceEP{addr: "10.244.1.5"}))
	}
	e.synced()
	e.sync()
	if got, want := e.conntrack.DumpUntranslated(), "10.96.0.51:53, 10.96.0.52:53, 10.96.0.53:53"; got != want {
		t.Errorf("ClearUntranslated calls (-want +got):\n-%q\n+%q", want, got)
	}
}

// TestSyncClearsUntranslatedUDPOnTheKernelPath: a kernel-path UDP port clears its untranslated
// entries when its endpoints go from none to some (kube-proxy's moment), not when they only change.
func TestSyncClearsUntranslatedUDPOnTheKernelPath(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.synced()
	slice := func(addrs ...string) *discovery.EndpointSlice {
		return udpSlice("kube-system", "dns", "a", 5353, addrs...)
	}
	const cleared = "10.96.0.53:53"
	e.p.OnServiceAdd(makeService("kube-system", "dns", "10.96.0.53", withDataPath("kernel"), udpPort("dns", 53)))
	e.sync()
	if got := e.conntrack.DumpUntranslated(); got != "" {
		t.Fatalf("no endpoints (REJECT): ClearUntranslated %q, want none", got)
	}
	e.p.OnEndpointSliceAdd(slice("10.244.1.1"))
	e.sync()
	e.p.OnEndpointSliceUpdate(slice("10.244.1.1"), slice("10.244.1.2"))
	e.sync()
	if got := e.conntrack.DumpUntranslated(); got != cleared {
		t.Errorf("endpoints none -> some -> others: ClearUntranslated (-want +got):\n-%q\n+%q", cleared, got)
	}
}
