package proxier

import (
	"context"
	"net/netip"
	"slices"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// onKernel reports whether a port takes the kernel path: it asks for it, the node has one, and
// nothing the port needs is done by the proxy alone.
func (c *Config) onKernel(port *service.Port) bool {
	return c.KernelPath && c.wantsKernel(port) && port.ProxyProtocol == ""
}

// toKernel puts a port on the kernel path. Its proxy socket, if open, is not closed yet: it is
// retired, and closed once a portal sync has replaced its portal rules by the kernel chains, so
// no new connection is refused in between; a TCP socket's established connections outlive the
// close (tcp.Proxy.Close keeps them).
func (d *dataPaths) toKernel(port *service.Port) {
	delete(d.failed, port.Name)
	d.mu.Lock()
	old := d.byName[port.Name]
	k, was := old.(*kernelPort)
	if was {
		k.port = port
	} else {
		d.byName[port.Name] = &kernelPort{port: port}
	}
	d.mu.Unlock()
	if d.kflows != nil {
		d.kflows.dirty = true
	}
	if !was {
		if old != nil {
			d.retiring = append(d.retiring, old) // the proxy socket: closed after the sync
		}
		d.markUnsynced(port.Name)
		d.log.WithField("service", port.Name.String()).Info("Service port on the kernel data path")
	}
}

// leaveKernel takes a port off the kernel path (it left, or moves to the proxy path); reports
// whether it was on it.
func (d *dataPaths) leaveKernel(name service.ServicePortName) bool {
	d.mu.Lock()
	k, was := d.byName[name].(*kernelPort)
	if was {
		delete(d.byName, name)
	}
	d.mu.Unlock()
	if !was {
		return false
	}
	// Retired, so that the sync after which it is gone clears its UDP flows (clearStaleKernelUDP).
	d.retiring = append(d.retiring, k)
	if d.kflows != nil {
		d.kflows.dirty = true
	}
	d.markUnsynced(name)
	return true
}

// kernelPort is a port on the kernel path: kube-proxy's chains DNAT its traffic straight to the
// endpoints its selection gives each traffic policy; no socket. applied is the port as of the
// last portal sync that worked, when it was a UDP port (clearStaleKernelUDP).
type kernelPort struct {
	port    *service.Port
	applied *kernelUDPPort
}

func (k *kernelPort) svcPort() *service.Port     { return k.port }
func (k *kernelPort) dataPath() service.DataPath { return service.DataPathKernel }
func (k *kernelPort) sockets() []ProxySocket     { return nil }

// retire does nothing at once: a kernel port's UDP flows are cleared by clearStaleKernelUDP,
// which reads the retired kernel ports.
func (k *kernelPort) retire(*dataPaths) {}

// kernelPorts are the ports on the kernel path, for the flow index. The caller holds d.mu.
func (d *dataPaths) kernelPorts() map[service.ServicePortName]*service.Port {
	out := map[service.ServicePortName]*service.Port{}
	for name, path := range d.byName {
		if k, ok := path.(*kernelPort); ok {
			out[name] = k.port
		}
	}
	return out
}

// spec lists the port's kernel chains, with the endpoints its selection gives each traffic
// policy.
func (k *kernelPort) spec(sel *portSelection) portal.Spec {
	port := k.port
	kp := &portal.KernelPath{InternalLocal: port.InternalLocal, ExternalLocal: port.ExternalLocal && port.ExternallyAccessible()}
	if port.Affinity.ClientIP {
		kp.AffinitySeconds = int(port.Affinity.TTL().Seconds())
	}
	if sel != nil {
		kp.AnyEndpoints = sel.HasAnyEndpoints
		switch {
		case !port.InternalLocal:
			kp.Cluster = sel.Internal.Endpoints
		case port.ExternallyAccessible():
			kp.Cluster = sel.ExternalFromNode.Endpoints
		}
		switch {
		case port.InternalLocal:
			kp.Local = sel.Internal.Endpoints
		case kp.ExternalLocal:
			kp.Local = sel.External.Endpoints
		}
	}
	return portal.Spec{
		Name: port.Name, Protocol: port.Protocol, Port: port.Port, NodePort: port.NodePort,
		ClusterIPs: port.ClusterIPs, ExternalIPs: port.ExternalIPs, LoadBalancerIPs: port.LoadBalancerIPs,
		SourceRanges: port.LoadBalancerSourceRanges, Kernel: kp,
	}
}

// endpointsEqual reports whether two selections hand the same endpoints to every class of
// traffic (what the kernel chains are made of).
func (s *portSelection) endpointsEqual(o *portSelection) bool {
	return o != nil && s.HasAnyEndpoints == o.HasAnyEndpoints &&
		slices.Equal(s.Internal.Endpoints, o.Internal.Endpoints) && slices.Equal(s.External.Endpoints, o.External.Endpoints) &&
		slices.Equal(s.ExternalFromNode.Endpoints, o.ExternalFromNode.Endpoints)
}

// kernelCounters reads the KUBE-SEP counters for the debug views, by service port; nil when no
// port is on the kernel path or they cannot be read (the view then shows none).
func (p *Proxier) kernelCounters() map[service.ServicePortName][]debugview.KernelEndpointView {
	p.paths.mu.RLock()
	n := len(p.paths.kernelPorts())
	p.paths.mu.RUnlock()
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

// kernelUDPSpecs lists the endpoints of the kernel-path UDP ports in specs, and whether any
// spec is on the kernel path.
func kernelUDPSpecs(specs []portal.Spec) (map[service.ServicePortName]kernelUDPPort, bool) {
	now := map[service.ServicePortName]kernelUDPPort{}
	anyKernel := false
	for _, s := range specs {
		if s.Kernel == nil {
			continue
		}
		anyKernel = true
		if s.Protocol == service.UDP {
			now[s.Name] = kernelUDPPort{endpoints: append(slices.Clone(s.Kernel.Cluster), s.Kernel.Local...)}
		}
	}
	return now, anyKernel
}

// clearStaleKernelUDP deletes the conntrack entries of a kernel-path UDP port that lost an
// endpoint or left the kernel path, after the sync that applied it. A UDP flow keeps its DNAT for
// as long as packets come (a resolver asking every second never lets the entry expire), so
// without this it would go on to an endpoint that is gone; with it, the next datagram is
// balanced again over the current endpoints, as kube-proxy does. Only the entries DNATed to an
// endpoint that is gone (every entry, when the port is gone). A port that moved to the proxy
// path keeps its established flows on their endpoint until they end, like TCP connections.
func (d *dataPaths) clearStaleKernelUDP(specs []portal.Spec) {
	now, anyKernel := kernelUDPSpecs(specs)
	var old []*kernelPort
	for _, path := range d.retiring {
		if k, ok := path.(*kernelPort); ok && k.applied != nil {
			old = append(old, k)
		}
	}
	if !anyKernel && len(old) == 0 {
		return // a node without kernel ports pays nothing per sync
	}
	var current []*kernelPort
	d.mu.RLock()
	for _, path := range d.byName {
		if k, ok := path.(*kernelPort); ok {
			current = append(current, k)
			if k.applied != nil {
				old = append(old, k)
			}
		}
	}
	d.mu.RUnlock()
	for _, k := range old {
		name := k.applied.port.Name
		cur, still := now[name]
		gone := !still && d.dataPathOf(name) == "" // removed, not moved to the proxy path
		var lost []netip.AddrPort
		if still {
			for _, e := range k.applied.endpoints {
				if !slices.Contains(cur.endpoints, e) {
					lost = append(lost, e)
				}
			}
		}
		if (gone || len(lost) > 0) && d.deps.Conntrack != nil {
			flows := conntrack.FlowsOf(k.applied.port)
			// Lost endpoints: their flows alone (kube-proxy's delete by --dst-nat); deleting
			// the others would lose the answers they have in flight.
			flows.Endpoints = lost
			if err := d.deps.Conntrack.ClearUDP(d.runCtx, flows); err != nil {
				d.log.WithField("service", name.String()).WithError(err).Warn("Clearing UDP conntrack entries")
			}
		}
	}
	for _, k := range current {
		k.applied = nil
		if cur, ok := now[k.port.Name]; ok {
			cur.port = k.port
			k.applied = &cur
		}
	}
}
