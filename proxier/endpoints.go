package proxier

// endpoints.go: the endpoint-applying work. Every Service or EndpointSlice event, and the sync
// when a port changes, hands the Service's endpoints to an endpointApplier, which selects the
// ones each class of traffic uses (topology.go), sets the balancer, drains or ends the flows of
// endpoints that left (drain.go), gives a hand-over predecessor's sticky clients to their ports
// (affinity.go), holds a restart snapshot's endpoints until the sources know better (restore.go)
// and counts the local endpoints of health-checked Services. It owns its locks; the Proxier
// holds one pointer to it and asks for a sync when apply reports that the portals must change.

import (
	"context"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/healthcheck"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// endpointApplier applies endpoint changes to the balancer, on the handler goroutines and the
// sync goroutine alike.
type endpointApplier struct {
	balancer *loadbalancer.LoadBalancer
	pods     *PodIndex
	health   ServiceHealth
	slices   *endpointSliceCache
	clock    clock.Clock
	log      logrus.FieldLogger
	// drainTCP and drainGrace are Config.DrainTCP and Config.DrainGrace.
	drainTCP   bool
	drainGrace time.Duration
	// refs: name each endpoint's pod and node in the balancer, for the flow stream's picks.
	refs bool

	// What the applier asks the proxier: a Service's ports and the node's topology as the
	// handlers last recorded them; the open socket of a port's class of traffic (nil when
	// none); whether a port is on the kernel path; the run context (drains stop on it).
	ports    func(service.NamespacedName) ([]*service.Port, NodeTopology)
	socketOf func(name service.ServicePortName, external bool) ProxySocket
	onKernel func(*service.Port) bool
	runCtx   func() context.Context

	// mu orders endpoint updates to the balancer (handlers and sync both apply them).
	mu sync.Mutex
	// inherited is a hand-over predecessor's affinity table until the ports take it (affinity.go).
	inherited inheritedAffinity

	// selMu guards sels, the endpoint selection of every service port, written by apply and read
	// by the sync (portal specs, refusals) and the debug view; and hcLocal, per Service with a
	// health check node port, its ready endpoints on this node.
	selMu   sync.RWMutex
	sels    map[service.ServicePortName]*portSelection
	hcLocal map[service.NamespacedName]int

	drains  drains
	restore restoreState
}

// apply recomputes the endpoints of every port of a Service, selects the ones each class of
// traffic uses on this node (traffic policies, topology hints, terminating fallback) and hands
// them to the balancer. Connections or sessions on endpoints that disappeared are dropped where
// that is the policy (UDP always; TCP with DrainTCP). It reports whether a port's refusals or
// socket split changed (or a kernel-path port's endpoints): the portals must change too.
func (e *endpointApplier) apply(name service.NamespacedName) bool {
	// The Service and its slices arrive on different goroutines, each storing its object and then
	// applying. Both are read under e.mu, so whichever applies last sees both: read before it, an
	// apply that had read the Service without its slice could run last and leave the port with no
	// endpoints (seen at 10,000 services: one port rejecting traffic until its next change).
	e.mu.Lock()
	defer e.mu.Unlock()
	ports, node := e.ports(name)
	sl := e.slices.get(name)

	rulesChanged := false
	for _, port := range ports {
		eps := endpointsFor(port, sl)
		e.pods.update(port.Name, eps)
		serving := func(ep netip.AddrPort) bool {
			i, ok := slices.BinarySearchFunc(eps, ep, func(e service.Endpoint, a netip.AddrPort) int { return e.Addr.Compare(a) })
			return ok && eps[i].Serving
		}
		sel := newPortSelection(port, selectEndpoints(port, eps, node))
		var refOf func(netip.AddrPort) *flow.EndpointRef
		if e.refs {
			refOf = endpointRefs(eps)
		}
		e.setBalancer(port, port.Name, sel.Internal, false, serving, refOf)
		if sel.split {
			e.setBalancer(port, externalName(port.Name), sel.External, true, serving, refOf)
		}
		if old := e.setSelection(port.Name, sel); !sel.rulesEqual(old) || (e.onKernel(port) && !sel.endpointsEqual(old)) {
			rulesChanged = true
			if old != nil && old.split && !sel.split {
				e.balancer.DeleteService(externalName(port.Name))
			}
		}
	}
	e.updateLocalCount(name, ports, sl, node.Name)
	return rulesChanged
}

// updateLocalCount recounts a Service's ready endpoints on this node when it has a health check
// node port, and tells the health check server when the count changed.
func (e *endpointApplier) updateLocalCount(name service.NamespacedName, ports []*service.Port, sl []*slimSlice, node string) {
	if e.health == nil {
		return
	}
	eps := map[service.ServicePortName][]service.Endpoint{}
	for _, port := range ports {
		if port.HealthCheckNodePort != 0 {
			eps[port.Name] = endpointsFor(port, sl)
		}
	}
	n, has := healthcheck.LocalReadyEndpoints(node, eps)[name]
	e.selMu.Lock()
	old, had := e.hcLocal[name]
	if has {
		e.hcLocal[name] = n
	} else {
		delete(e.hcLocal, name)
	}
	var snapshot map[service.NamespacedName]int
	if old != n || had != has {
		snapshot = maps.Clone(e.hcLocal)
	}
	e.selMu.Unlock()
	if snapshot != nil {
		e.health.SyncEndpoints(snapshot)
	}
}

// setBalancer gives one balancer entry (a port's cluster traffic, or a split port's external
// traffic) its endpoints, and ends or drains the flows of those that left it (endRemoved).
func (e *endpointApplier) setBalancer(port *service.Port, key service.ServicePortName, sel Selection, external bool, serving func(netip.AddrPort) bool,
	refOf func(netip.AddrPort) *flow.EndpointRef) {
	usable := sel.Endpoints
	if e.keepRestored(key, usable) {
		return // the restart snapshot's endpoints serve until the sources know this port's
	}
	e.balancer.SetAffinity(key, port.Affinity)
	e.balancer.SetBalancing(key, port.Balancing)
	e.balancer.SetPickWhy(key, sel.pickWhy())
	sock := e.drainable(port, external)
	var before []netip.AddrPort
	if sock != nil { // only then is the old list needed
		before = e.balancer.Service(key).Endpoints()
	}
	e.balancer.SetEndpoints(key, usable)
	if refOf != nil {
		e.balancer.SetEndpointRefs(key, refOf)
	}
	e.takeInherited(key, len(usable))
	e.wakeHeld(port, external, usable)
	if sock != nil {
		e.endRemoved(sock, port, key, before, usable, serving)
	}
}

// endpointRefs names the pod and node of each of a port's endpoints (eps sorted by address, as
// endpointsFor gives them), for the balancer's picks.
func endpointRefs(eps []service.Endpoint) func(netip.AddrPort) *flow.EndpointRef {
	return func(ep netip.AddrPort) *flow.EndpointRef {
		i, ok := slices.BinarySearchFunc(eps, ep, func(e service.Endpoint, a netip.AddrPort) int { return e.Addr.Compare(a) })
		if !ok || (eps[i].TargetRef.Name == "" && eps[i].NodeName == "") {
			return nil
		}
		r := &flow.EndpointRef{Node: eps[i].NodeName}
		if eps[i].TargetRef.Name != "" {
			r.Pod = eps[i].TargetRef.String()
		}
		return r
	}
}

// drainable returns the open socket of a port whose flows on endpoints leaving the rotation are
// ended or drained (UDP always, TCP with DrainTCP or a drain-timeout), or nil.
func (e *endpointApplier) drainable(port *service.Port, external bool) ProxySocket {
	if port.Protocol == service.TCP && !e.drainTCP && port.DrainTimeout == 0 {
		return nil
	}
	return e.socketOf(port.Name, external)
}
