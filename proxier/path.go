package proxier

// path.go: every service port this node serves takes one data path, and the proxier keeps them
// in one map (Proxier.paths). Two paths exist: the proxy-socket path (activePort, sync.go: portal
// rules redirect to a proxy socket that picks an endpoint) and the kernel path (kernelPort,
// kernelpath.go: kube-proxy's chains DNAT straight to the endpoints). The sync picks a path per
// port (reconcileService), asks every path for its portal spec (specs), and a port that switches
// paths retires the old one only after a portal sync that worked (retirePaths), so no new
// connection is refused in between.

import (
	"cmp"
	"iter"
	"slices"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// portPath is how one service port's traffic reaches its endpoints on this node.
type portPath interface {
	// svcPort is the service port as the path last took it.
	svcPort() *service.Port
	// dataPath names the path (the debug views, DataPathOf).
	dataPath() service.DataPath
	// spec is the portal spec that leads the port's traffic into the path, given the port's
	// endpoint selection (nil before its first).
	spec(sel *portSelection) portal.Spec
	// sockets are the proxy sockets that serve the path (none on the kernel path).
	sockets() []ProxySocket
	// retire ends what is left of a path the port no longer takes, after the portal sync that
	// replaced its rules worked. Called by the sync goroutine.
	retire(p *Proxier)
}

var (
	_ portPath = (*activePort)(nil)
	_ portPath = (*kernelPort)(nil)
)

// socketOf is the proxy-socket path of a port, or nil when it has none (kernel path, socket
// failed, unknown). The caller holds pathMu.
func (p *Proxier) socketOf(name service.ServicePortName) *activePort {
	a, _ := p.paths[name].(*activePort)
	return a
}

// socketPaths yields the ports on the proxy-socket path. The caller holds pathMu.
func (p *Proxier) socketPaths() iter.Seq2[service.ServicePortName, *activePort] {
	return func(yield func(service.ServicePortName, *activePort) bool) {
		for name, path := range p.paths {
			if a, ok := path.(*activePort); ok && !yield(name, a) {
				return
			}
		}
	}
}

// specs lists the portal spec of every port's path, sorted by name for stable rule output.
func (p *Proxier) specs() []portal.Spec {
	p.pathMu.RLock()
	p.eps.selMu.RLock()
	if p.kflows != nil && p.kflows.dirty {
		p.kflows.rebuild(p.kernelPorts())
	}
	out := make([]portal.Spec, 0, len(p.paths))
	for name, path := range p.paths {
		out = append(out, path.spec(p.eps.sels[name]))
	}
	p.eps.selMu.RUnlock()
	p.pathMu.RUnlock()
	slices.SortFunc(out, func(a, b portal.Spec) int {
		return cmp.Or(cmp.Compare(a.Name.Namespace, b.Name.Namespace), cmp.Compare(a.Name.Name, b.Name.Name),
			cmp.Compare(a.Name.Port, b.Name.Port))
	})
	return out
}

// retirePaths ends the paths that ports left, after a portal sync that worked: first the proxy
// sockets of ports that moved to the kernel path (closeRetired's order: their UDP conntrack
// entries, then the socket), then the conntrack entries of kernel-path UDP ports that lost
// endpoints or left (clearStaleKernelUDP).
func (p *Proxier) retirePaths(specs []portal.Spec) {
	for _, path := range p.retiring {
		path.retire(p)
	}
	p.clearStaleKernelUDP(specs)
	p.retiring = nil
}

// DataPathOf reports the data path a service port is on right now (for the debug views):
// kernel, proxy, or "" when the port is unknown or has no socket (failed).
func (p *Proxier) DataPathOf(name service.ServicePortName) service.DataPath {
	p.pathMu.RLock()
	defer p.pathMu.RUnlock()
	if path, ok := p.paths[name]; ok {
		return path.dataPath()
	}
	return ""
}
