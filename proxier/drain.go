package proxier

import (
	"net/netip"
	"sort"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// How the flows of an endpoint that leaves a port's rotation (turns terminating, or is removed)
// end. The drain-timeout annotation wins per Service; --drain-removed-endpoints is the default of
// the Services without it:
//
//	drain-timeout D  TCP and UDP: the flows go on; D after the endpoint left, what is left is
//	                 closed (TCP: FIN both ways, then a reset DrainGrace later). Back in the
//	                 rotation before then, nothing is closed.
//	flag on          TCP: reset at once, unless the endpoint is still serving (terminating but
//	                 serving): then its connections go on until it stops serving or is removed.
//	flag off         TCP: the connections go on for ever (they end when a peer ends them).
//	no annotation    UDP: the sessions end at once; the clients' next datagrams move.

// DefaultDrainGrace is how long a TCP connection closed by its drain deadline has, after the
// FINs, to close before it is reset.
const DefaultDrainGrace = 2 * time.Second

// drainer is a proxy socket that can close an endpoint's flows at its drain deadline (TCP: FIN
// both ways, then a reset after grace).
type drainer interface {
	DrainEndpoint(ep netip.AddrPort, grace time.Duration) int
}

// drainKey is an endpoint of one balancer entry (a port's cluster traffic, or a split port's
// external traffic, which has its own socket).
type drainKey struct {
	key service.ServicePortName
	ep  netip.AddrPort
}

// drains tracks the endpoints out of rotation whose flows are kept: those with a deadline (the
// annotation) and, under --drain-removed-endpoints, the still-serving ones kept until they stop.
type drains struct {
	mu      sync.Mutex
	pending map[drainKey]*pendingDrain
	serving map[drainKey]bool
	wg      sync.WaitGroup
}

type pendingDrain struct {
	deadline time.Time
	stop     chan struct{}
}

// endRemoved applies the drain policy to the endpoints that left a balancer entry's rotation
// (before, not in after), and calls off the drains of those back in it. serving reports whether
// an endpoint is still in the Service's EndpointSlices and serving.
func (e *endpointApplier) endRemoved(sock ProxySocket, port *service.Port, key service.ServicePortName, before, after []netip.AddrPort, serving func(netip.AddrPort) bool) {
	in := make(map[netip.AddrPort]bool, len(after))
	for _, ep := range after {
		in[ep] = true
	}
	e.drains.returned(key, in)
	for _, ep := range before {
		if in[ep] {
			continue
		}
		switch {
		case port.DrainTimeout > 0:
			e.startDrain(sock, port, drainKey{key, ep})
		case port.Protocol == service.UDP:
			e.drop(sock, port, ep)
		case !e.drainTCP:
		case serving(ep):
			e.drains.keepServing(drainKey{key, ep})
		default:
			e.drop(sock, port, ep)
		}
	}
	if port.Protocol == service.TCP && e.drainTCP {
		for _, ep := range e.drains.stoppedServing(key, serving) {
			e.drop(sock, port, ep)
		}
	}
}

func (e *endpointApplier) drop(sock ProxySocket, port *service.Port, ep netip.AddrPort) {
	if n := sock.DropEndpoint(ep); n > 0 {
		e.log.WithFields(logrus.Fields{"service": port.Name.String(), "endpoint": ep.String(), "count": n}).
			Info("Closed connections to a removed endpoint")
	}
}

// startDrain closes the endpoint's flows on sock at its drain deadline, port.DrainTimeout from
// now, unless it comes back first. A drain already under way keeps its deadline.
func (e *endpointApplier) startDrain(sock ProxySocket, port *service.Port, k drainKey) {
	d, ok := sock.(drainer)
	ctx := e.runCtx()
	if !ok || ctx == nil {
		return
	}
	pd := &pendingDrain{deadline: e.clock.Now().Add(port.DrainTimeout), stop: make(chan struct{})}
	if !e.drains.add(k, pd) {
		return
	}
	t := e.clock.NewTimer(port.DrainTimeout)
	grace := e.drainGrace
	if grace <= 0 {
		grace = DefaultDrainGrace
	}
	go func() {
		defer e.drains.wg.Done()
		defer t.Stop()
		select {
		case <-t.C():
		case <-pd.stop:
			return
		case <-ctx.Done():
			return
		}
		if !e.drains.remove(k, pd) {
			return // called off in the meantime
		}
		n := d.DrainEndpoint(k.ep, grace)
		if n > 0 {
			e.log.WithFields(logrus.Fields{"service": port.Name.String(), "endpoint": k.ep.String(), "count": n,
				"drain_timeout": port.DrainTimeout.String()}).Info("Drain deadline passed, closing the connections left on an endpoint out of rotation")
		}
	}()
}

// add records a drain; false if one is under way for k (the goroutine is then not started).
func (d *drains) add(k drainKey, pd *pendingDrain) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.pending[k]; ok {
		return false
	}
	if d.pending == nil {
		d.pending = map[drainKey]*pendingDrain{}
	}
	d.pending[k] = pd
	d.wg.Add(1)
	return true
}

// remove forgets pd if it is still k's drain.
func (d *drains) remove(k drainKey, pd *pendingDrain) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.pending[k] != pd {
		return false
	}
	delete(d.pending, k)
	return true
}

// returned calls off the drains (and the serving holds) of key's endpoints back in rotation.
func (d *drains) returned(key service.ServicePortName, in map[netip.AddrPort]bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, pd := range d.pending {
		if k.key == key && in[k.ep] {
			close(pd.stop)
			delete(d.pending, k)
		}
	}
	for k := range d.serving {
		if k.key == key && in[k.ep] {
			delete(d.serving, k)
		}
	}
}

func (d *drains) keepServing(k drainKey) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.serving == nil {
		d.serving = map[drainKey]bool{}
	}
	d.serving[k] = true
}

// stoppedServing forgets and returns key's held endpoints that no longer serve.
func (d *drains) stoppedServing(key service.ServicePortName, serving func(netip.AddrPort) bool) []netip.AddrPort {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []netip.AddrPort
	for k := range d.serving {
		if k.key == key && !serving(k.ep) {
			delete(d.serving, k)
			out = append(out, k.ep)
		}
	}
	return out
}

// views lists key's endpoints waiting for their drain deadline, sorted.
func (d *drains) views(key service.ServicePortName, now time.Time) []debugview.DrainView {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []debugview.DrainView
	for k, pd := range d.pending {
		if k.key == key {
			out = append(out, debugview.DrainView{Endpoint: k.ep.String(), ClosesIn: pd.deadline.Sub(now).Round(time.Second).String()})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Endpoint < out[j].Endpoint })
	return out
}
