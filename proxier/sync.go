package proxier

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
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
	p.paths.synced(specs, len(changes) > 0 || !p.firstSynced)
	if !p.firstSynced {
		// The first sync after a start built every socket and rule at once: its garbage (the
		// decoded objects, tens of thousands of rule strings, the restore inputs) is the peak of
		// the process's heap. Hand it back now rather than over the next minutes.
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
	d.clearUntranslatedUDP(specs)
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

// startPort opens a proxy socket for a service port and starts serving it.
func (d *dataPaths) startPort(port *service.Port) {
	filter := newSourceFilter(port.LoadBalancerSourceRanges)
	sock, proxyPort, err := d.open(port, false, filter)
	if err != nil {
		if _, already := d.failed[port.Name]; !already {
			d.portLog(port).WithError(err).Error("Cannot open proxy socket; the service port gets no portal until it can")
			if d.deps.Event != nil {
				reason := "ProxySocketFailed"
				if errors.Is(err, ErrPortsExhausted) {
					reason = "ProxyPortRangeExhausted"
				}
				d.deps.Event(port.Name, reason, err.Error())
			}
		}
		d.failed[port.Name] = port
		d.deps.Metrics.SocketFailures.Inc()
		return
	}
	delete(d.failed, port.Name)
	d.markUnsynced(port.Name)
	a := d.serve(port, sock, proxyPort)
	a.filter, a.split = filter, splitsExternal(port)
	d.mu.Lock()
	d.byName[port.Name] = a
	d.mu.Unlock()
	d.portLog(port).WithField("proxyPort", proxyPort).Debug("Opened proxy socket")
	d.reconcileSplit(a)
}

// portLog is the logger of one service port's socket, built only when there is something to log
// (at 10,000 ports a logger kept per socket held 3.5 MB).
func (d *dataPaths) portLog(port *service.Port) logrus.FieldLogger {
	return d.log.WithFields(logrus.Fields{"service": port.Name.String(), "protocol": string(port.Protocol)})
}

// serve runs an opened socket in a goroutine the socket WaitGroup tracks. Every socket runs on the
// run context itself: closeSocket and shutdown stop one with Close, so a context of its own per
// socket (with the parent's entry for it, and the socket's AfterFunc registered on it) was 10,000
// contexts and maps, about 8 MB, at 10,000 service ports.
func (d *dataPaths) serve(port *service.Port, sock ProxySocket, proxyPort uint16) *activePort {
	ctx := d.runCtx
	a := &activePort{port: port, sock: sock, proxyPort: proxyPort}
	if st, ok := sock.(starter); ok {
		if started, err := st.Start(); started {
			if err != nil {
				d.portLog(port).WithError(err).Error("Proxy socket stopped")
			}
			return a
		}
	}
	d.socketWG.Add(1)
	go func() {
		defer d.socketWG.Done()
		if err := sock.Run(ctx); err != nil && ctx.Err() == nil {
			d.portLog(port).WithError(err).Error("Proxy socket stopped")
		}
	}()
	return a
}

// reconcileSplits gives every open port whose external traffic needs its own socket that socket,
// and closes the ones no longer needed (a policy changed under a live port). A socket that failed
// to open is tried again here at every sync.
func (d *dataPaths) reconcileSplits() {
	d.mu.RLock()
	var todo []*activePort
	for _, a := range d.socketPaths() {
		if splitsExternal(a.port) != (a.ext != nil) || (d.cfg.ListenPlan != nil && splitsExternal(a.port) != a.split) {
			todo = append(todo, a)
		}
	}
	d.mu.RUnlock()
	for _, a := range todo {
		if d.cfg.ListenPlan != nil && splitsExternal(a.port) != a.split {
			// Bind mode: unsplit, the port's one socket listens on the external addresses too, so
			// a split (or its end) changes that socket's addresses, and the port reopens.
			d.stopPort(a.port.Name, false)
			d.startPort(a.port)
			continue
		}
		d.reconcileSplit(a)
	}
}

// reconcileSplit opens or closes the external socket of one open port as its policies need.
func (d *dataPaths) reconcileSplit(a *activePort) {
	want := splitsExternal(a.port)
	if want == (a.ext != nil) {
		return
	}
	log := d.portLog(a.port)
	d.markUnsynced(a.port.Name)
	if !want {
		d.mu.Lock()
		ext := a.ext
		a.ext = nil
		d.mu.Unlock()
		d.closeSocket(ext)
		d.deps.Balancer.DeleteService(externalName(a.port.Name))
		return
	}
	sock, proxyPort, err := d.open(a.port, true, a.filter)
	if err != nil {
		if !d.extFailed[a.port.Name] {
			log.WithError(err).Error("Cannot open the external-traffic socket; external traffic is refused until it can")
			d.extFailed[a.port.Name] = true
		}
		d.deps.Metrics.SocketFailures.Inc()
		return
	}
	delete(d.extFailed, a.port.Name)
	ext := d.serve(a.port, sock, proxyPort)
	ext.filter = a.filter
	d.mu.Lock()
	a.ext = ext
	d.mu.Unlock()
	log.WithField("proxyPort", proxyPort).Debug("Opened external-traffic socket")
}

// open allocates a proxy port and opens the socket on it, for the port's cluster traffic or, when
// external is true, for its external traffic. With a port range, a port that another process holds
// is skipped. In bind mode, the sockets on load-balancer IPs check clients against filter.
func (d *dataPaths) open(port *service.Port, external bool, filter *sourceFilter) (ProxySocket, uint16, error) {
	key := port.Name
	if external {
		key = externalName(port.Name)
	}
	build := func(at netip.AddrPort) ProxySocket {
		return d.deps.Sockets(port, d.deps.Balancer.Service(key), d.allowFor(port, at, filter))
	}
	if d.cfg.ListenPlan != nil {
		plan := d.cfg.ListenPlan(port)
		if splitsExternal(port) {
			internal, ext := splitPlan(port, plan)
			plan = internal
			if external {
				plan = ext
			}
		}
		if len(plan) == 0 {
			return nil, 0, fmt.Errorf("service port %s: no address to listen on", port.Name)
		}
		m, err := openAll(plan, build)
		if err != nil {
			return nil, 0, fmt.Errorf("service port %s: %w", port.Name, err)
		}
		return m, port.Port, nil
	}
	if pp, ok := d.restart.keepPort[key]; ok {
		delete(d.restart.keepPort, key)
		if d.ports.take(pp) {
			sock, err := d.listenFamilies(port, pp, build)
			if err == nil {
				return sock, pp, nil
			}
			d.ports.release(pp)
		}
	}
	var lastErr error
	for range maxListenTries {
		pp, err := d.ports.allocate()
		if err != nil {
			return nil, 0, fmt.Errorf("service port %s: %w", port.Name, err)
		}
		sock, err := d.listenFamilies(port, pp, build)
		if err == nil {
			return sock, sock.Addr().Port(), nil
		}
		d.ports.release(pp)
		lastErr = fmt.Errorf("service port %s: %w", port.Name, err)
		if !d.ports.retries() || !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
	}
	return nil, 0, lastErr
}

// listenFamilies opens the proxy socket on --bind-address, or, when that is unspecified, on the
// wildcard of each family the port's portals use (the sockets are single-family), all on one port
// number so one set of portal rules per family leads to them.
func (d *dataPaths) listenFamilies(port *service.Port, pp uint16, build func(netip.AddrPort) ProxySocket) (ProxySocket, error) {
	ips := []netip.Addr{d.cfg.ListenIP}
	if d.cfg.ListenIP.IsUnspecified() {
		ips = wildcards(port)
	}
	first := build(netip.AddrPortFrom(ips[0], pp))
	if err := first.Listen(netip.AddrPortFrom(ips[0], pp)); err != nil {
		return nil, err
	}
	if len(ips) == 1 {
		return first, nil
	}
	rest, err := openAll([]netip.AddrPort{netip.AddrPortFrom(ips[1], first.Addr().Port())}, build)
	if err != nil {
		_ = first.Close()
		return nil, err
	}
	return &multiSocket{socks: append([]ProxySocket{first}, rest.socks...)}, nil
}

// wildcards lists 0.0.0.0 and/or :: for the families of a port's portal addresses (IPv4 first).
func wildcards(port *service.Port) []netip.Addr {
	var v4, v6 bool
	for _, group := range [][]netip.Addr{port.ClusterIPs, port.ExternalIPs, port.LoadBalancerIPs} {
		for _, ip := range group {
			if ip.Is4() {
				v4 = true
			} else {
				v6 = true
			}
		}
	}
	switch {
	case v4 && v6:
		return []netip.Addr{netip.IPv4Unspecified(), netip.IPv6Unspecified()}
	case v6:
		return []netip.Addr{netip.IPv6Unspecified()}
	default:
		return []netip.Addr{netip.IPv4Unspecified()}
	}
}

// stopPort closes a service port's sockets. gone means the port no longer exists at all, so its
// balancer state and endpoint selection go too; a changed port keeps them (endpoints and affinity
// survive, as in legacy).
func (d *dataPaths) stopPort(name service.ServicePortName, gone bool) {
	d.mu.Lock()
	a := d.socketOf(name)
	if a != nil {
		delete(d.byName, name)
	}
	d.mu.Unlock()
	delete(d.extFailed, name)
	if gone {
		d.deps.Balancer.DeleteService(name)
		d.deps.Balancer.DeleteService(externalName(name))
		d.eps.setSelection(name, nil)
	}
	if a == nil {
		return
	}
	d.markUnsynced(name)
	d.closeSocket(a)
	if a.ext != nil {
		d.closeSocket(a.ext)
	}
	if a.port.Protocol == service.UDP && d.deps.Conntrack != nil {
		// Conntrack would keep steering a chatty client (a resolver) to the closed proxy port.
		if err := d.deps.Conntrack.ClearUDP(d.runCtx, conntrack.FlowsOf(a.port)); err != nil {
			d.log.WithField("service", name.String()).WithError(err).Warn("Clearing UDP conntrack entries")
		}
	}
}

// closeSocket stops one socket and gives its proxy port back.
func (d *dataPaths) closeSocket(a *activePort) {
	if err := a.sock.Close(); err != nil {
		d.log.WithField("service", a.port.Name.String()).WithError(err).Warn("Closing proxy socket")
	}
	if d.cfg.ListenPlan == nil {
		d.ports.release(a.proxyPort)
	}
}

// The proxy-socket path: portal rules redirect the port's traffic to a proxy socket (and a
// split port's external traffic to a second one), which picks an endpoint per connection.

func (a *activePort) svcPort() *service.Port     { return a.port }
func (a *activePort) dataPath() service.DataPath { return service.DataPathProxy }

// spec points the port's portals at its proxy ports. A port refuses the traffic it has no
// endpoint for; a split port whose external socket is not open refuses external traffic rather
// than send it to the cluster socket's endpoints.
func (a *activePort) spec(sel *portSelection) portal.Spec {
	s := portal.Spec{
		Name: a.port.Name, Protocol: a.port.Protocol, Port: a.port.Port, NodePort: a.port.NodePort,
		ClusterIPs: a.port.ClusterIPs, ExternalIPs: a.port.ExternalIPs, LoadBalancerIPs: a.port.LoadBalancerIPs,
		ProxyPort: a.proxyPort, SourceRanges: a.port.LoadBalancerSourceRanges,
	}
	if sel != nil {
		s.RejectInternal, s.RejectExternal = sel.rejectInternal, sel.rejectExternal
	}
	if a.ext != nil {
		s.ExternalProxyPort = a.ext.proxyPort
	} else if splitsExternal(a.port) {
		s.RejectExternal = true
	}
	return s
}

func (a *activePort) sockets() []ProxySocket {
	if a.ext == nil {
		return []ProxySocket{a.sock}
	}
	return []ProxySocket{a.sock, a.ext.sock}
}

// retire closes the sockets of a port that moved to the kernel path, after the sync that applied
// its chains. A UDP port's conntrack entries redirected to its proxy socket go first, the socket
// after: a client whose new datagram reuses the source port of an entry not yet deleted (UDP
// entries live 30 s; a resolver opens a new port per query, so some do) is still answered by the
// socket, where a closed one would answer port unreachable (the chaos soak saw it while the
// delete walked the table, 80 ms; TestDataPathUDPSwitchesLive saw one refusal per switch).
func (a *activePort) retire(d *dataPaths) {
	if a.port.Protocol == service.UDP && d.deps.Conntrack != nil {
		// Only those entries: the kernel chains are in force by now, and an entry their DNAT
		// made for a datagram in flight must stay, or the endpoint's answer is lost.
		flows := conntrack.FlowsOf(a.port)
		flows.ProxyPorts = []uint16{a.proxyPort}
		if a.ext != nil {
			flows.ProxyPorts = append(flows.ProxyPorts, a.ext.proxyPort)
		}
		start := d.cfg.Clock.Now()
		if err := d.deps.Conntrack.ClearUDP(d.runCtx, flows); err != nil {
			d.log.WithField("service", a.port.Name.String()).WithError(err).Warn("Clearing UDP conntrack entries")
		}
		d.log.WithField("service", a.port.Name.String()).WithField("duration", d.cfg.Clock.Since(start)).
			Debug("Cleared the UDP conntrack entries redirected to the proxy socket the kernel path replaced")
	}
	d.closeSocket(a)
	if a.ext != nil {
		d.closeSocket(a.ext)
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

// markUnsynced records that a service port's portal spec changed.
func (d *dataPaths) markUnsynced(name service.ServicePortName) {
	if d.unsynced == nil {
		d.unsynced = make(map[service.ServicePortName]struct{})
	}
	d.unsynced[name] = struct{}{}
}

// unsyncedNames lists the service ports changed since the last good portal sync, sorted, at most
// limit of them and how many more.
func (d *dataPaths) unsyncedNames(limit int) string {
	if len(d.unsynced) == 0 {
		return "none"
	}
	names := make([]string, 0, len(d.unsynced))
	for n := range d.unsynced {
		names = append(names, n.String())
	}
	slices.Sort(names)
	if len(names) <= limit {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:limit], ", "), len(names)-limit)
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
