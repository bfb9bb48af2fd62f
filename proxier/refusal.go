package proxier

import (
	"errors"
	"net/netip"
	"slices"
	"sync/atomic"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// refuser is a proxy socket that can stop listening and listen again on the same address while
// it stays (tcp.Proxy, udp.Proxy; a multiSocket passes it on to its members). With nothing
// listening, the kernel refuses each new connection itself (RST, ICMP port unreachable).
type refuser interface {
	SetRefusing(on bool) error
}

// SetRefusing sets every member; it tries them all and returns their errors joined.
func (m *multiSocket) SetRefusing(on bool) error {
	var errs []error
	for _, s := range m.socks {
		if r, ok := s.(refuser); ok {
			errs = append(errs, r.SetRefusing(on))
		}
	}
	return errors.Join(errs...)
}

// reconcileRefusals is bind mode's counterpart of the portal REJECT rules: a socket whose class
// of traffic (cluster, or a split port's external) has no usable endpoint stops listening, so the
// kernel refuses new connections at once, and listens again as soon as an endpoint appears. The
// portal spec stays, so the service addresses stay on the interface. Established TCP connections
// are kept (only the listener closes). A socket that cannot listen again is retried at the next
// sync; meanwhile it keeps refusing.
func (d *dataPaths) reconcileRefusals() {
	if d.cfg.ListenPlan == nil {
		return // iptables mode: the portal rules refuse
	}
	d.mu.RLock()
	d.eps.selMu.RLock()
	type change struct {
		a    *activePort
		want bool
	}
	var todo []change
	for name, a := range d.socketPaths() {
		sel := d.eps.sels[name]
		internal, external := false, false
		if sel != nil {
			internal, external = sel.rejectInternal, sel.rejectExternal
		}
		if a.refusing != internal {
			todo = append(todo, change{a, internal})
		}
		if a.ext != nil && a.ext.refusing != external {
			todo = append(todo, change{a.ext, external})
		}
	}
	d.eps.selMu.RUnlock()
	d.mu.RUnlock()
	for _, c := range todo {
		r, ok := c.a.sock.(refuser)
		if !ok {
			continue
		}
		log := d.log.WithFields(logrus.Fields{"service": c.a.port.Name.String(), "protocol": string(c.a.port.Protocol)})
		if err := r.SetRefusing(c.want); err != nil {
			log.WithError(err).Error("Cannot reopen the proxy socket of a service port that has endpoints again; retrying at the next sync")
			continue
		}
		d.mu.Lock()
		c.a.refusing = c.want
		d.mu.Unlock()
		d.listenChanged = true
		log.WithField("refusing", c.want).Debug("Proxy socket refusing changed")
	}
}

// sourceFilter is the loadBalancerSourceRanges check of one service port's sockets on its
// load-balancer IPs in bind mode. The ranges can change under a live socket (they are not part of
// SocketEqual), so the check reads them on every use.
type sourceFilter struct {
	ranges atomic.Pointer[[]netip.Prefix]
}

func newSourceFilter(ranges []netip.Prefix) *sourceFilter {
	f := &sourceFilter{}
	f.set(ranges)
	return f
}

// set replaces the ranges; a nil filter (a socket without one: iptables mode, where the rules
// check the ranges, and sockets reopened at start) ignores it.
func (f *sourceFilter) set(ranges []netip.Prefix) {
	if f == nil {
		return
	}
	r := slices.Clone(ranges)
	f.ranges.Store(&r)
}

// allow reports whether client may reach the load-balancer IPs: no ranges allow everyone.
func (f *sourceFilter) allow(client netip.Addr) bool {
	ranges := *f.ranges.Load()
	if len(ranges) == 0 {
		return true
	}
	client = client.Unmap()
	for _, r := range ranges {
		if r.Contains(client) {
			return true
		}
	}
	return false
}

// allowFor returns the source check for a socket of port listening at addr: the port's filter for
// a bind-mode socket on a load-balancer IP, nil (every client) for any other.
func (d *dataPaths) allowFor(port *service.Port, at netip.AddrPort, f *sourceFilter) func(netip.Addr) bool {
	if d.cfg.ListenPlan == nil || f == nil || at.Port() != port.Port || !slices.Contains(port.LoadBalancerIPs, at.Addr()) {
		return nil
	}
	return f.allow
}

// countRefused sets the refused-service-ports gauge from the portal specs (both modes): how many
// ports refuse their cluster traffic, and how many that take external traffic refuse it.
func (d *dataPaths) countRefused(specs []portal.Spec) {
	var internal, external int
	for _, s := range specs {
		if s.RejectInternal {
			internal++
		}
		if s.RejectExternal && (s.NodePort != 0 || len(s.ExternalIPs) > 0 || len(s.LoadBalancerIPs) > 0) {
			external++
		}
	}
	d.deps.Metrics.RefusedPorts.WithLabelValues("cluster").Set(float64(internal))
	d.deps.Metrics.RefusedPorts.WithLabelValues("external").Set(float64(external))
}
