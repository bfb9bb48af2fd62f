package proxier

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// AnnotationDataPath picks a Service's data path: "proxy" (portal rules to a proxy socket) or
// "kernel" (kube-proxy's iptables chains straight to the endpoints, portal/kernel). Unset: the
// node's --default-data-path.
const AnnotationDataPath = "portal-proxy.kubernetes.io/data-path"

// dataPath reads the data-path annotation; a value that does not parse is reported (wrapping
// ErrInvalidAnnotation) and the node default used.
func dataPath(svc *v1.Service) (service.DataPath, error) {
	v, ok := svc.Annotations[AnnotationDataPath]
	if !ok {
		return "", nil
	}
	switch d := service.DataPath(strings.TrimSpace(v)); d {
	case service.DataPathProxy, service.DataPathKernel:
		return d, nil
	}
	return "", fmt.Errorf("service %s/%s: annotation %s=%s: want kernel or proxy; the node's --default-data-path applies: %w",
		svc.Namespace, svc.Name, AnnotationDataPath, quoteValue(v), ErrInvalidAnnotation)
}

// kernelConflicts reports, for a Service whose ports would take the kernel path, why some cannot:
// the node has no kernel path (bind mode: no NAT), or a port needs the proxy (a PROXY protocol
// header is written by the proxy socket). Those ports take the proxy path.
func (p *Proxier) kernelConflicts(name service.NamespacedName, ports []*service.Port) []error {
	var errs []error
	for _, port := range ports {
		if !p.wantsKernel(port) {
			continue
		}
		switch {
		case !p.cfg.KernelPath:
			errs = append(errs, fmt.Errorf("service %s: data path kernel: this node's portal mode has no kernel path (bind mode has no NAT); the proxy path applies: %w",
				name, ErrInvalidAnnotation))
			return errs
		case port.ProxyProtocol != "":
			errs = append(errs, fmt.Errorf("service port %s: data path kernel cannot send a PROXY protocol header; the proxy path applies: %w",
				port.Name, ErrInvalidAnnotation))
		}
	}
	return errs
}

// wantsKernel reports whether a port asks for the kernel path, by annotation or node default.
func (p *Proxier) wantsKernel(port *service.Port) bool {
	return port.DataPath == service.DataPathKernel || (port.DataPath == "" && p.cfg.DefaultDataPath == service.DataPathKernel)
}

// onKernel reports whether a port takes the kernel path: it asks for it, the node has one, and
// nothing the port needs is done by the proxy alone.
func (p *Proxier) onKernel(port *service.Port) bool {
	return p.cfg.KernelPath && p.wantsKernel(port) && port.ProxyProtocol == ""
}

// toKernel puts a port on the kernel path. Its proxy socket, if open, is not closed yet: it is
// retired, and closed once a portal sync has replaced its portal rules by the kernel chains, so
// no new connection is refused in between; a TCP socket's established connections outlive the
// close (tcp.Proxy.Close keeps them).
func (p *Proxier) toKernel(port *service.Port) {
	delete(p.failed, port.Name)
	p.activeMu.Lock()
	a := p.active[port.Name]
	delete(p.active, port.Name)
	_, was := p.kernel[port.Name]
	p.kernel[port.Name] = port
	p.activeMu.Unlock()
	if p.kflows != nil {
		p.kflows.dirty = true
	}
	if a != nil {
		p.retiring = append(p.retiring, a)
	}
	if a != nil || !was {
		p.markUnsynced(port.Name)
		p.log.WithField("service", port.Name.String()).Info("Service port on the kernel data path")
	}
}

// leaveKernel takes a port off the kernel path (it left, or moves to the proxy path); reports
// whether it was on it.
func (p *Proxier) leaveKernel(name service.ServicePortName) bool {
	p.activeMu.Lock()
	_, was := p.kernel[name]
	delete(p.kernel, name)
	p.activeMu.Unlock()
	if was && p.kflows != nil {
		p.kflows.dirty = true
	}
	if was {
		p.markUnsynced(name)
	}
	return was
}

// closeRetired closes the sockets of ports that moved to the kernel path, after the sync that
// applied their chains. A UDP port's conntrack entries redirected to its proxy socket go first,
// the socket after: a client whose new datagram reuses the source port of an entry not yet
// deleted (UDP entries live 30 s; a resolver opens a new port per query, so some do) is still
// answered by the socket, where a closed one would answer port unreachable (the chaos soak saw
// it while the delete walked the table, 80 ms; TestDataPathUDPSwitchesLive saw one refusal per
// switch).
func (p *Proxier) closeRetired() {
	for _, a := range p.retiring {
		if a.port.Protocol == service.UDP && p.deps.Conntrack != nil {
			// Only those entries: the kernel chains are in force by now, and an entry their DNAT
			// made for a datagram in flight must stay, or the endpoint's answer is lost.
			flows := conntrack.FlowsOf(a.port)
			flows.ProxyPorts = []uint16{a.proxyPort}
			if a.ext != nil {
				flows.ProxyPorts = append(flows.ProxyPorts, a.ext.proxyPort)
			}
			start := p.cfg.Clock.Now()
			if err := p.deps.Conntrack.ClearUDP(p.runCtx, flows); err != nil {
				p.log.WithField("service", a.port.Name.String()).WithError(err).Warn("Clearing UDP conntrack entries")
			}
			p.log.WithField("service", a.port.Name.String()).WithField("duration", p.cfg.Clock.Since(start)).
				Debug("Cleared the UDP conntrack entries redirected to the proxy socket the kernel path replaced")
		}
		p.closeSocket(a)
		if a.ext != nil {
			p.closeSocket(a.ext)
		}
	}
	p.retiring = nil
}

// kernelSpecs lists the specs of the ports on the kernel path, with the endpoints their
// selections give each traffic policy. The caller holds activeMu and selMu (read).
func (p *Proxier) kernelSpecs(out []portal.Spec) []portal.Spec {
	p.kflows.rebuild(p.kernel)
	for _, port := range p.kernel {
		out = append(out, kernelSpec(port, p.sels[port.Name]))
	}
	return out
}

func kernelSpec(port *service.Port, sel *portSelection) portal.Spec {
	k := &portal.KernelPath{InternalLocal: port.InternalLocal, ExternalLocal: port.ExternalLocal && port.ExternallyAccessible()}
	if port.Affinity.ClientIP {
		k.AffinitySeconds = int(port.Affinity.TTL().Seconds())
	}
	if sel != nil {
		k.AnyEndpoints = sel.HasAnyEndpoints
		switch {
		case !port.InternalLocal:
			k.Cluster = sel.Internal.Endpoints
		case port.ExternallyAccessible():
			k.Cluster = sel.ExternalFromNode.Endpoints
		}
		switch {
		case port.InternalLocal:
			k.Local = sel.Internal.Endpoints
		case k.ExternalLocal:
			k.Local = sel.External.Endpoints
		}
	}
	return portal.Spec{
		Name: port.Name, Protocol: port.Protocol, Port: port.Port, NodePort: port.NodePort,
		ClusterIPs: port.ClusterIPs, ExternalIPs: port.ExternalIPs, LoadBalancerIPs: port.LoadBalancerIPs,
		SourceRanges: port.LoadBalancerSourceRanges, Kernel: k,
	}
}

// endpointsEqual reports whether two selections hand the same endpoints to every class of
// traffic (what the kernel chains are made of).
func (s *portSelection) endpointsEqual(o *portSelection) bool {
	return o != nil && s.HasAnyEndpoints == o.HasAnyEndpoints &&
		slices.Equal(s.Internal.Endpoints, o.Internal.Endpoints) && slices.Equal(s.External.Endpoints, o.External.Endpoints) &&
		slices.Equal(s.ExternalFromNode.Endpoints, o.ExternalFromNode.Endpoints)
}

// DataPathOf reports the data path a service port is on right now (for the debug views):
// kernel, proxy, or "" when the port is unknown or has no socket (failed).
func (p *Proxier) DataPathOf(name service.ServicePortName) service.DataPath {
	p.activeMu.RLock()
	defer p.activeMu.RUnlock()
	if _, ok := p.kernel[name]; ok {
		return service.DataPathKernel
	}
	if _, ok := p.active[name]; ok {
		return service.DataPathProxy
	}
	return ""
}

// kernelCounters reads the KUBE-SEP counters for the debug views, by service port; nil when no
// port is on the kernel path or they cannot be read (the view then shows none).
func (p *Proxier) kernelCounters() map[service.ServicePortName][]debugview.KernelEndpointView {
	p.activeMu.RLock()
	n := len(p.kernel)
	p.activeMu.RUnlock()
	if n == 0 || p.deps.KernelCounters == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cs, err := p.deps.KernelCounters(ctx)
	if err != nil {
		p.log.WithError(err).Debug("Reading the kernel path's counters")
	}
	out := map[service.ServicePortName][]debugview.KernelEndpointView{}
	for _, c := range cs {
		out[c.Name] = append(out[c.Name], debugview.KernelEndpointView{Endpoint: c.Endpoint.String(), Chain: c.Chain,
			Packets: c.Packets, Bytes: c.Bytes})
	}
	return out
}

// kernelUDPPort is a kernel-path UDP port as last applied.
type kernelUDPPort struct {
	port      *service.Port
	endpoints []netip.AddrPort
}

// clearStaleKernelUDP deletes the conntrack entries of a kernel-path UDP port that lost an
// endpoint or left the kernel path, after the sync that applied it. A UDP flow keeps its DNAT for
// as long as packets come (a resolver asking every second never lets the entry expire), so
// without this it would go on to an endpoint that is gone; with it, the next datagram is
// balanced again over the current endpoints, as kube-proxy does. Only the entries DNATed to an
// endpoint that is gone (every entry, when the port is gone). A port that moved to the proxy
// path keeps its established flows on their endpoint until they end, like TCP connections.
func (p *Proxier) clearStaleKernelUDP(specs []portal.Spec) {
	p.activeMu.RLock()
	none := len(p.kernel) == 0
	p.activeMu.RUnlock()
	if none && len(p.kernelUDP) == 0 {
		return // a node without kernel ports pays nothing per sync
	}
	now := map[service.ServicePortName]kernelUDPPort{}
	p.activeMu.RLock()
	for _, s := range specs {
		if s.Kernel != nil && s.Protocol == service.UDP && p.kernel[s.Name] != nil {
			now[s.Name] = kernelUDPPort{port: p.kernel[s.Name], endpoints: append(slices.Clone(s.Kernel.Cluster), s.Kernel.Local...)}
		}
	}
	p.activeMu.RUnlock()
	for name, old := range p.kernelUDP {
		cur, still := now[name]
		gone := !still && p.DataPathOf(name) == "" // removed, not moved to the proxy path
		var lost []netip.AddrPort
		if still {
			for _, e := range old.endpoints {
				if !slices.Contains(cur.endpoints, e) {
					lost = append(lost, e)
				}
			}
		}
		if (gone || len(lost) > 0) && p.deps.Conntrack != nil {
			flows := conntrack.FlowsOf(old.port)
			// Lost endpoints: their flows alone (kube-proxy's delete by --dst-nat); deleting
			// the others would lose the answers they have in flight.
			flows.Endpoints = lost
			if err := p.deps.Conntrack.ClearUDP(p.runCtx, flows); err != nil {
				p.log.WithField("service", name.String()).WithError(err).Warn("Clearing UDP conntrack entries")
			}
		}
	}
	p.kernelUDP = now
}
