package proxier

// restore.go: the reopened sockets of a restarted proxy (restart.go) accept at once, but a
// connection can only be forwarded once its service's endpoints are known, and the sources know
// nothing before their initial lists are decoded (1-3 s at 10,000 Services). The daemon therefore
// keeps a snapshot of what the proxy serves (package snapshot), and a process started after a
// SIGKILL gives the reopened sockets' balancer entries the snapshot's endpoints (Restore) until
// the initial Services and EndpointSlices are in. Then the snapshot is dropped whole: an entry
// the sources did not fill by then is emptied and filled again from them, so nothing of the
// snapshot survives the initial lists. The trade-off: for the seconds of the cold start a
// connection may go to an endpoint that went away while no proxy ran (kube-proxy's iptables rules
// stay in force the same way); its dial fails and the client retries.

import (
	"iter"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// restoreState is the proxier's restore (Restore until dropRestored) and the generation of
// what Snapshot returns.
type restoreState struct {
	mu sync.Mutex
	// keys are the balancer entries that still hold the snapshot's endpoints; done: the initial
	// lists are in, the restore is over.
	keys map[service.ServicePortName]struct{}
	done bool
	gen  atomic.Uint64
	// pending are the snapshot's ports Restore accepted, applied by the reopen each just before
	// its socket opens (applyRestored).
	pending map[service.ServicePortName]*snapshot.Port
	// activity is when each port last carried traffic (restoreactivity.go).
	activity activity
}

// Restore gives the balancer entries of the sockets Run reopens (Reopen) the endpoints and
// balancer settings of a snapshot, until the initial Services and EndpointSlices are in. Only
// service ports that are reopened, with the same protocol, are restored. It orders the reopen by
// the snapshot's activity: the ports used most recently first. Call it after Reopen and
// before Run and the sources start. It returns how many service ports it restored.
//
// The entries are filled by Run's reopen, each just before its socket opens and on the reopen's
// threads (applyRestored): filled here, before Run, they took 100-750 ms at 10,000 ports beside
// a CPU hog, on one thread, before the first socket opened.
func (p *Proxier) Restore(st *snapshot.State) int {
	if st == nil {
		return 0
	}
	seeded := make(map[service.ServicePortName]service.Protocol, len(p.paths.restart.seeds))
	for _, s := range p.paths.restart.seeds {
		seeded[s.Name] = s.Protocol
	}
	p.eps.restore.mu.Lock()
	defer p.eps.restore.mu.Unlock()
	if p.eps.restore.keys == nil {
		p.eps.restore.keys = make(map[service.ServicePortName]struct{})
	}
	if p.eps.restore.pending == nil {
		p.eps.restore.pending = make(map[service.ServicePortName]*snapshot.Port)
	}
	n := 0
	stamps := map[service.ServicePortName]int64{}
	for i := range st.Ports {
		sp := &st.Ports[i]
		if !sp.LastActive.IsZero() {
			stamps[sp.Name] = sp.LastActive.Unix()
			p.eps.restore.activity.restored(sp.Name, sp.LastActive)
		}
		if proto, ok := seeded[sp.Name]; !ok || proto != sp.Protocol {
			continue
		}
		p.eps.restore.pending[sp.Name] = sp
		n++
	}
	// Whatever the seeds came from (the snapshot, the rules in force, the bind state), the
	// reopen opens the ports the node's clients used last first.
	byActivity(p.paths.restart.seeds, func(name service.ServicePortName) int64 { return stamps[name] })
	return n
}

// applyRestored fills the balancer entries of a reopened service port from the snapshot Restore
// took, if it has the port and the initial lists are not in yet. The reopen calls it for each
// seed before opening the seed's socket, so no connection finds the entry empty.
func (e *endpointApplier) applyRestored(name service.ServicePortName) {
	e.restore.mu.Lock()
	defer e.restore.mu.Unlock()
	sp := e.restore.pending[name]
	if sp == nil || e.restore.done {
		return
	}
	delete(e.restore.pending, name)
	e.restoreEntry(sp.Name, sp, sp.Internal)
	if sp.Split {
		e.restoreEntry(externalName(sp.Name), sp, sp.External)
	}
}

// The caller holds e.restore.mu.
func (e *endpointApplier) restoreEntry(key service.ServicePortName, sp *snapshot.Port, eps []snapshot.Endpoint) {
	e.balancer.SetAffinity(key, sp.Affinity)
	e.balancer.SetBalancing(key, sp.Balancing)
	e.balancer.SetEndpoints(key, snapshot.Addrs(eps))
	e.restore.keys[key] = struct{}{}
}

// keepRestored reports whether a balancer entry keeps its snapshot endpoints rather than take
// usable: before the initial lists are in, a Service often arrives before its EndpointSlices, so
// an empty selection then says "not known yet", not "no endpoint". The first update with
// endpoints replaces the snapshot's.
func (e *endpointApplier) keepRestored(key service.ServicePortName, usable []netip.AddrPort) bool {
	e.restore.mu.Lock()
	defer e.restore.mu.Unlock()
	if _, ok := e.restore.keys[key]; !ok {
		return false
	}
	if len(usable) == 0 && !e.restore.done {
		return true
	}
	delete(e.restore.keys, key)
	return false
}

// dropRestored ends the restore once the initial lists are in, before held connections are
// released: the entries still holding snapshot endpoints (the sources gave their ports none, or
// dropped the ports) are emptied, then filled from the sources again.
func (e *endpointApplier) dropRestored() []service.NamespacedName {
	e.restore.mu.Lock()
	left := e.restore.keys
	e.restore.keys, e.restore.done, e.restore.pending = nil, true, nil
	e.restore.mu.Unlock()
	if len(left) == 0 {
		return nil
	}
	services := map[service.NamespacedName]bool{}
	e.mu.Lock()
	for key := range left {
		e.balancer.SetEndpoints(key, nil)
		e.balancer.SetAffinity(key, service.Affinity{})
		e.balancer.SetBalancing(key, service.Balancing{})
		services[key.ServiceName()] = true
	}
	e.mu.Unlock()
	e.log.WithField("servicePorts", len(left)).Info("Initial Services and EndpointSlices are in; dropped the restart snapshot's endpoints they did not replace")
	return slices.Collect(maps.Keys(services))
}

// restoredGate is the gate of a reopened UDP socket: open at once when its entry has the
// snapshot's endpoints, otherwise reopenGate.
func (d *dataPaths) restoredGate(key service.ServicePortName) <-chan struct{} {
	d.eps.restore.mu.Lock()
	_, ok := d.eps.restore.keys[key]
	if !ok { // taken by Restore, not yet applied (applyRestored)
		internal := key
		internal.Port = strings.TrimSuffix(key.Port, externalName(service.ServicePortName{}).Port)
		if sp := d.eps.restore.pending[internal]; sp != nil {
			ok = key == sp.Name || sp.Split
		}
	}
	d.eps.restore.mu.Unlock()
	if ok {
		return closedChan
	}
	return d.reopenGate()
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// SnapshotGeneration changes whenever what Snapshot returns may have changed (an endpoint
// selection, or a sync that changed sockets): the daemon writes a snapshot only then.
func (p *Proxier) SnapshotGeneration() uint64 { return p.eps.restore.gen.Load() }

// Snapshot is what the proxy serves now through its sockets (SnapshotPorts), as one State.
func (p *Proxier) Snapshot(node string) *snapshot.State {
	st := &snapshot.State{Node: node, Written: p.cfg.Clock.Now()}
	for sp := range p.SnapshotPorts() {
		c := *sp
		c.Internal, c.External = slices.Clone(sp.Internal), slices.Clone(sp.External)
		st.Ports = append(st.Ports, c)
	}
	return st
}

// SnapshotPorts yields what the proxy serves now through its sockets: every service port with a
// selection (ports on the kernel data path have no socket and are left out), its proxy ports,
// balancer settings and the endpoints of each class of traffic with their conditions. The Port
// yielded is reused: it is valid during the yield only, so a snapshot of 10,000 ports streams
// into its file without being whole in memory (snapshot.WritePorts). It is safe to call from any
// goroutine.
func (p *Proxier) SnapshotPorts() iter.Seq[*snapshot.Port] {
	return func(yield func(*snapshot.Port) bool) {
		p.mu.Lock()
		ports := make([]*service.Port, 0, len(p.latest))
		for _, sp := range p.latest {
			ports = append(ports, sp...)
		}
		p.mu.Unlock()
		var sp snapshot.Port
		for _, port := range ports {
			p.eps.selMu.RLock()
			sel := p.eps.sels[port.Name]
			p.eps.selMu.RUnlock()
			p.paths.mu.RLock()
			path := p.paths.byName[port.Name]
			a := p.paths.socketOf(port.Name)
			kernel := path != nil && path.dataPath() == service.DataPathKernel
			var proxyPort, extPort uint16
			if a != nil {
				proxyPort = a.proxyPort
				if a.ext != nil {
					extPort = a.ext.proxyPort
				}
			}
			p.paths.mu.RUnlock()
			if sel == nil || kernel {
				continue
			}
			sp = snapshot.Port{Name: port.Name, Protocol: port.Protocol, ProxyPort: proxyPort, ExternalProxyPort: extPort,
				Affinity: port.Affinity, Balancing: port.Balancing, Split: sel.split,
				Internal: snapshotEndpoints(sp.Internal[:0], sel.Internal), External: sp.External[:0],
				LastActive: p.eps.restore.activity.lastActive(port.Name)}
			if sel.split {
				sp.External = snapshotEndpoints(sp.External, sel.External)
			}
			if !yield(&sp) {
				return
			}
		}
	}
}

// snapshotEndpoints appends to out a selection's endpoints with their conditions, which the selection
// implies (selectEndpoints, as kube-proxy's CategorizeEndpoints): ready ones (ready endpoints are
// serving, and not terminating), or when there are none, serving-terminating ones (the reason
// says fallback=terminating). Reading them from the EndpointSlices instead (endpointsOf) took
// 30 MB in 90,000 allocations per snapshot at 10,000 ports (BenchmarkSnapshot10000Ports).
func snapshotEndpoints(out []snapshot.Endpoint, sel Selection) []snapshot.Endpoint {
	terminating := strings.Contains(sel.Reason, "fallback=terminating")
	for _, a := range sel.Endpoints {
		out = append(out, snapshot.Endpoint{Addr: a, Ready: !terminating, Serving: true, Terminating: terminating})
	}
	return out
}
