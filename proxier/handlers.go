package proxier

// handlers.go: the proxier's side of package config's handlers. As kube-proxy's, they record
// a change and ask for a sync: a Service is converted (convert.go) and recorded in the change
// tracker (changes.go), an EndpointSlice in the slice cache; both apply the Service's endpoints
// to the balancer at once (endpoints.go). Nothing is programmed here: the sync does (sync.go).

import (
	"errors"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/config"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The proxier takes its events from a source of package config.
var _ config.Handler = (*Proxier)(nil)

// OnServiceAdd is called when a Service appears.
func (p *Proxier) OnServiceAdd(svc *v1.Service) { p.OnServiceUpdate(nil, svc) }

// OnServiceDelete is called when a Service is removed.
func (p *Proxier) OnServiceDelete(svc *v1.Service) { p.onService(nsName(svc.Namespace, svc.Name), nil) }

// OnServiceUpdate is called when a Service changes (old is nil for an add).
func (p *Proxier) OnServiceUpdate(_, svc *v1.Service) {
	ports, errs := p.cfg.servicePorts(svc)
	for _, err := range errs {
		p.log.WithField("service", svc.Namespace+"/"+svc.Name).WithError(err).Warn("Ignoring part of a service")
		if errors.Is(err, ErrUnsupportedProtocol) {
			p.deps.Metrics.UnsupportedPorts.Inc()
		}
	}
	p.onService(nsName(svc.Namespace, svc.Name), ports)
	p.warnAnnotations(nsName(svc.Namespace, svc.Name), errs)
}

// ReasonInvalidAnnotation is the Warning event recorded on a Service whose
// portal-proxy.kubernetes.io/ annotations do not parse.
const ReasonInvalidAnnotation = "InvalidAnnotation"

// annotationWarnings remembers what was last reported about each Service's annotations, so that
// an unchanged bad value (every resync, every unrelated update) is not reported again.
type annotationWarnings struct {
	mu   sync.Mutex
	last map[service.NamespacedName]string
}

// changed records the Service's annotation errors (nil for none) and reports whether they differ
// from the last ones.
func (w *annotationWarnings) changed(name service.NamespacedName, errs []error) (string, bool) {
	var msgs []string
	for _, err := range errs {
		if errors.Is(err, ErrInvalidAnnotation) {
			msgs = append(msgs, err.Error())
		}
	}
	msg := strings.Join(msgs, "; ")
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.last == nil {
		w.last = map[service.NamespacedName]string{}
	}
	if w.last[name] == msg {
		return msg, false
	}
	if msg == "" {
		delete(w.last, name)
	} else {
		w.last[name] = msg
	}
	return msg, true
}

// warnAnnotations records a Warning event on a Service when its annotation errors change to a
// new non-empty set. (The errors themselves are logged with the other conversion errors.)
func (p *Proxier) warnAnnotations(name service.NamespacedName, errs []error) {
	msg, changed := p.annotations.changed(name, errs)
	if !changed || msg == "" || p.deps.Event == nil {
		return
	}
	p.deps.Event(service.ServicePortName{Namespace: name.Namespace, Name: name.Name}, ReasonInvalidAnnotation, msg)
}

// onService records the ports a Service now has; none (deleted, headless, ...) means absent.
func (p *Proxier) onService(name service.NamespacedName, ports []*service.Port) {
	p.mu.Lock()
	previous := p.latest[name]
	if len(ports) == 0 {
		delete(p.latest, name)
		ports = nil
	} else {
		p.latest[name] = ports
	}
	pending := p.svcChanges.update(name, previous, ports)
	synced := p.servicesSynced && p.endpointsSynced
	p.mu.Unlock()
	p.deps.Metrics.ServiceChanges.Inc()
	// Endpoints are matched to ports by name and protocol, so a port change may change them.
	p.applyEndpoints(name)
	if pending && synced {
		p.deps.Health.QueuedUpdate()
		p.runner.Trigger()
	}
}

// OnServicesSynced is called once the initial Service list is delivered.
func (p *Proxier) OnServicesSynced() { p.setSynced(func() { p.servicesSynced = true }) }

// OnEndpointSlicesSynced is called once the initial EndpointSlice list is delivered.
func (p *Proxier) OnEndpointSlicesSynced() { p.setSynced(func() { p.endpointsSynced = true }) }

func (p *Proxier) setSynced(set func()) {
	p.mu.Lock()
	set()
	ready := p.servicesSynced && p.endpointsSynced
	p.mu.Unlock()
	if ready {
		p.markEndpointsReady()
		p.runner.Trigger()
	}
}

// OnEndpointSliceAdd is called when an EndpointSlice appears.
func (p *Proxier) OnEndpointSliceAdd(s *discovery.EndpointSlice) { p.onSlice(s, false) }

// OnEndpointSliceUpdate is called when an EndpointSlice changes.
func (p *Proxier) OnEndpointSliceUpdate(_, s *discovery.EndpointSlice) { p.onSlice(s, false) }

// OnEndpointSliceDelete is called when an EndpointSlice is removed.
func (p *Proxier) OnEndpointSliceDelete(s *discovery.EndpointSlice) { p.onSlice(s, true) }

func (p *Proxier) onSlice(s *discovery.EndpointSlice, deleted bool) {
	owner, err := config.SliceOwner(s)
	if err != nil {
		p.log.WithError(err).Debug("Ignoring EndpointSlice")
		return
	}
	var slim *slimSlice
	if !deleted {
		slim = convertSlice(s)
	}
	p.slices.update(owner, s.Name, slim)
	p.deps.Metrics.EndpointChanges.Inc()
	// Endpoint changes reach the balancer now, not at the next rules sync.
	rulesChanged := p.applyEndpoints(owner)
	// network_programming_duration_seconds as kube-proxy measures it: from the trigger time the
	// EndpointSlice controller stamps on the slice to the change in force, only for slices that
	// carry one from after this proxier started (not the initial list's), never for a deletion
	// (its annotation is of the last update). In force is now (the balancer has the endpoints),
	// or after the next sync when the change also changed rules (a port's refusal).
	if deleted {
		return
	}
	if at, ok := triggerTime(s); ok && at.After(p.started) {
		tr := trigger{family: familyLabel(s.AddressType), at: at}
		if !rulesChanged {
			p.deps.Metrics.ObserveProgramming(tr.family, p.cfg.Clock.Now(), tr.at)
			return
		}
		p.mu.Lock()
		p.pendingTriggers = append(p.pendingTriggers, tr)
		p.mu.Unlock()
		// A sync applyEndpoints asked for may have taken the pending list already: ask again, so
		// this one is observed by the next sync (coalesced, at most a minimum sync period later)
		// rather than the periodic one.
		p.runner.Trigger()
	}
}

// trigger is an endpoint change's trigger time, waiting for the sync that puts it in force.
type trigger struct {
	family string
	at     time.Time
}

// familyLabel is kube-proxy's ip_family label value of a slice's address type.
func familyLabel(t discovery.AddressType) string {
	if t == discovery.AddressTypeIPv6 {
		return string(v1.IPv6Protocol)
	}
	return string(v1.IPv4Protocol)
}

// triggerTime is when the change that produced this slice happened, from the annotation the
// EndpointSlice controller sets (false without one, or when it does not parse).
func triggerTime(s *discovery.EndpointSlice) (time.Time, bool) {
	v, ok := s.Annotations[v1.EndpointsLastChangeTriggerTime]
	if !ok {
		return time.Time{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	return t, err == nil
}

// applyEndpoints selects a Service's endpoints again and hands them to the balancer
// (endpointApplier.apply). When a port's refusals or socket split changed, the portals must
// change too, so a sync is asked for (and true returned).
func (p *Proxier) applyEndpoints(name service.NamespacedName) bool {
	rulesChanged := p.eps.apply(name)
	// Read after the selections are in: when the initial lists are reported synced meanwhile,
	// either this sees it and triggers, or the sync that setSynced triggers reads them. (Read
	// before, a slice delivered during the first sync could be left out of it and never synced:
	// its service rejected traffic until an unrelated change.)
	p.mu.Lock()
	synced := p.servicesSynced && p.endpointsSynced
	p.mu.Unlock()
	if rulesChanged && synced {
		p.deps.Health.QueuedUpdate()
		p.runner.Trigger()
	}
	return rulesChanged
}

// portsOf is a Service's ports and the node's topology as the handlers last recorded them.
func (p *Proxier) portsOf(name service.NamespacedName) ([]*service.Port, NodeTopology) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.latest[name], p.node
}

func nsName(ns, name string) service.NamespacedName {
	return service.NamespacedName{Namespace: ns, Name: name}
}

// endpointsOf is the current endpoints of a service port (none if it is not known).
func (p *Proxier) endpointsOf(name service.ServicePortName) []service.Endpoint {
	p.mu.Lock()
	var port *service.Port
	for _, sp := range p.latest[name.ServiceName()] {
		if sp.Name == name {
			port = sp
		}
	}
	p.mu.Unlock()
	if port == nil {
		return nil
	}
	return endpointsFor(port, p.slices.get(name.ServiceName()))
}
