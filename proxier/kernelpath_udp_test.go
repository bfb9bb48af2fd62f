package proxier

import (
	"context"
	"fmt"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestUDPToKernelClearsOnlyRedirectedEntries: a UDP port that moves from the proxy socket to the
// kernel path has its conntrack entries cleared after the sync that put the kernel chains in,
// only those the portal rules redirected to its old proxy port, and before its socket closes.
// Clearing all of them also deleted the entries the new DNAT rules had made for datagrams in
// flight (their answers were lost); closing first refused a client whose new datagram matched an
// entry not yet deleted (a source port reused within the entries' 30 s): both seen in the chaos
// soak right after the switch (issue 34).
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
	sock := e.open[dnsName]
	openAtClear := false
	var clearedAfter time.Duration
	start := time.Now()
	e.p.deps.Conntrack = clearWatch{e.conntrack, func() { openAtClear, clearedAfter = !isClosed(sock), time.Since(start) }}

	e.p.OnServiceUpdate(nil, makeService("kube-system", "dns", "10.96.0.53", withDataPath("kernel"), udpPort("dns", 53)))
	start = time.Now() // the sync puts the kernel chains in force, then retires the socket
	e.sync()
	// A query that took the old portal just before the sync is answered through the socket
	// within milliseconds: its entry stays that long (the soak lost such an answer).
	if clearedAfter < udpRetireGrace {
		t.Errorf("the redirected entries were cleared %v after the sync began, want at least %v", clearedAfter, udpRetireGrace)
	}
	if got, want := e.conntrack.Dump(), fmt.Sprintf("udp 10.96.0.53:53 via [%d]", spec.ProxyPort); got != want {
		t.Errorf("after the move to the kernel path conntrack cleared %q, want %q", got, want)
	}
	if !openAtClear || !isClosed(sock) {
		t.Errorf("the proxy socket was open when its entries were cleared: %v, closed after the sync: %v; want both", openAtClear, isClosed(sock))
	}
}

// TestKernelUDPLostEndpointClearsOnlyItsEntries: a kernel-path UDP port that loses an endpoint
// has the entries DNATed to that endpoint cleared, and only those (kube-proxy's delete by
// --dst-nat): clearing every entry of the service also lost the answers the endpoints that stay
// had in flight. Address plan: service 10.96.0.53:53/UDP, endpoints 10.244.1.1-2:5353.
func TestKernelUDPLostEndpointClearsOnlyItsEntries(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.KernelPath = true })
	e.synced()
	slice := func(addrs ...string) *discovery.EndpointSlice {
		return udpSlice("kube-system", "dns", "a", 5353, addrs...)
	}
	e.p.OnServiceAdd(makeService("kube-system", "dns", "10.96.0.53", withDataPath("kernel"), udpPort("dns", 53)))
	e.p.OnEndpointSliceAdd(slice("10.244.1.1", "10.244.1.2"))
	e.sync()
	e.conntrack.Reset()
	e.p.OnEndpointSliceUpdate(nil, slice("10.244.1.2"))
	e.sync()
	if got, want := e.conntrack.Dump(), "udp 10.96.0.53:53 to [10.244.1.1:5353]"; got != want {
		t.Errorf("an endpoint removed: conntrack cleared %q, want %q", got, want)
	}
}

// clearWatch is the fake conntrack, calling onClear at each ClearUDP.
type clearWatch struct {
	*conntrack.Fake
	onClear func()
}

func (c clearWatch) ClearUDP(ctx context.Context, f conntrack.Flows) error {
	c.onClear()
	return c.Fake.ClearUDP(ctx, f)
}
