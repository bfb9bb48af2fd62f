package proxier

import (
	"context"
	"fmt"
	"runtime/debug"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// maxListenTries bounds how many range ports one service port tries when others are taken by
// processes outside the proxy.
const maxListenTries = 16

// sync is the one function the runner calls: apply the coalesced Service changes to the proxy
// sockets, retry sockets that failed to open, then make the portals match the open sockets. A
// service port whose socket cannot open gets no portal, and the others are unaffected.
func (p *Proxier) sync(ctx context.Context) error {
	if !p.initialized() {
		p.log.Debug("Not syncing until Services and EndpointSlices have synced")
		return nil
	}
	start := p.cfg.Clock.Now()
	changes := p.svcChanges.take()
	p.mu.Lock()
	triggers := p.pendingTriggers
	p.pendingTriggers = nil
	p.mu.Unlock()

	specs := p.paths.reconcile(changes)
	// changes are not read after this: a first sync's (10,000 ports, 1.2 MB) is garbage before
	// the portal sync builds its rules.
	changed := len(changes) > 0
	err := p.deps.Portals.Sync(ctx, specs)
	end := p.cfg.Clock.Now()
	m := p.deps.Metrics
	m.SyncDuration.Observe(end.Sub(start).Seconds())
	m.PendingServiceChanges.Set(float64(p.svcChanges.pending()))
	m.ActivePorts.Set(float64(socketSpecs(specs)))
	m.FailedPorts.Set(float64(len(p.paths.failed)))
	if err != nil {
		m.SyncFailures.Inc()
		m.SyncFailing.Set(1)
		// Not in force yet: the next sync that works observes them.
		p.mu.Lock()
		p.pendingTriggers = append(triggers, p.pendingTriggers...)
		p.mu.Unlock()
		return fmt.Errorf("sync portals of %d service ports (changed since the last good sync: %s): %w",
			len(specs), p.paths.unsyncedNames(5), err)
	}
	p.paths.synced(specs, changed || !p.firstSynced)
	if !p.firstSynced {
		// The first sync after a start built every socket and rule at once: its garbage (the
		// decoded objects, each socket's setup, the rule text of the rules built) left the heap
		// near its peak. Hand it back now rather than over the next minutes.
		p.firstSynced = true
		if p.cfg.AfterFirstSync != nil {
			p.cfg.AfterFirstSync()
		}
		debug.FreeOSMemory()
		p.eps.endInherited()
		p.markFirstSync()
	}
	m.LastSync.Set(float64(end.UnixNano()) / 1e9)
	m.SyncFailing.Set(0)
	for _, t := range triggers {
		m.ObserveProgramming(t.family, end, t.at)
	}
	p.deps.Health.Updated()
	if p.deps.ServiceHealth != nil {
		p.deps.ServiceHealth.SyncServices(p.paths.healthCheckPorts())
	}
	if n := p.deps.Balancer.CleanupStaleAffinity(); n > 0 {
		p.log.WithField("count", n).Debug("Removed expired affinity entries")
	}
	return nil
}

// reconcile applies the coalesced Service changes to the ports' paths, retries the sockets that
// failed to open, reconciles split sockets and (bind mode) refusals, and returns the portal specs
// of every path.
func (d *dataPaths) reconcile(changes map[service.NamespacedName]*serviceChange) []portal.Spec {
	for name, ch := range changes {
		if ch.current == nil {
			delete(d.services, name)
		} else {
			d.services[name] = ch.current
		}
		d.reconcileService(ch.previous, ch.current)
	}
	d.dropUnwantedSeeds()
	d.retryFailed()
	d.reconcileSplits()
	d.reconcileRefusals()
	specs := d.specs()
	d.countRefused(specs)
	return specs
}

// synced ends what the portal sync that worked has replaced (retired paths, stale conntrack
// entries) and saves the bind-mode listen state when sockets changed (or changed is true).
func (d *dataPaths) synced(specs []portal.Spec, changed bool) {
	d.retirePaths(specs)
	d.clearUntranslated(specs)
	if changed || len(d.unsynced) > 0 || d.listenChanged {
		d.saveListenState()
	}
	d.unsynced, d.listenChanged = nil, false
}

// reconcileService brings the sockets of one Service from its previous ports to its current ones.
func (d *dataPaths) reconcileService(previous, current []*service.Port) {
	want := make(map[service.ServicePortName]*service.Port, len(current))
	for _, port := range current {
		want[port.Name] = port
	}
	for _, old := range previous {
		if _, still := want[old.Name]; !still {
			d.stopPort(old.Name, true)
			d.leaveKernel(old.Name)
			delete(d.failed, old.Name)
		}
	}
	for _, port := range current {
		if d.cfg.onKernel(port) {
			d.toKernel(port)
			continue
		}
		d.leaveKernel(port.Name)
		d.mu.RLock()
		a := d.socketOf(port.Name)
		d.mu.RUnlock()
		switch {
		case a != nil && (a.port.SocketEqual(port) || d.adoptable(a, port)):
			d.mu.Lock()
			a.port = port
			if a.ext != nil {
				a.ext.port = port
			}
			d.mu.Unlock()
			a.filter.set(port.LoadBalancerSourceRanges)
		case a != nil:
			if d.restart.seeded[port.Name] && d.cfg.ListenPlan == nil { // reopened at start: open again where the rules point
				d.restart.keepPort[port.Name] = a.proxyPort
			}
			// The port or an address changed: the legacy proxy reopened the socket too.
			d.stopPort(port.Name, false)
			d.startPort(port)
		default:
			d.startPort(port)
		}
	}
}

// retryFailed tries again to open the sockets that could not open before.
func (d *dataPaths) retryFailed() {
	for _, port := range d.failed {
		d.startPort(port)
	}
}

// socketSpecs counts the specs of the proxy-socket path (the active-ports gauge).
func socketSpecs(specs []portal.Spec) int {
	n := 0
	for i := range specs {
		if specs[i].Kernel == nil {
			n++
		}
	}
	return n
}

// healthCheckPorts lists the health check node port of every Service that has one.
func (d *dataPaths) healthCheckPorts() map[service.NamespacedName]uint16 {
	out := map[service.NamespacedName]uint16{}
	for name, ports := range d.services {
		for _, port := range ports {
			if port.HealthCheckNodePort != 0 {
				out[name] = port.HealthCheckNodePort
			}
		}
	}
	return out
}
