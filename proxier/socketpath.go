package proxier

// socketpath.go: the proxy-socket path of a service port (a portPath, path.go): its socket
// opened, served, split for external traffic, refused, closed and retired. The kernel path is
// its sibling in kernelpath.go.

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/loglevel"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// activePort is a service port with an open proxy socket.
type activePort struct {
	port      *service.Port
	sock      ProxySocket
	proxyPort uint16
	// ext is the socket of the port's external traffic when it has its own (splitsExternal).
	ext *activePort
	// split: the socket was opened for the port's cluster traffic only (splitsExternal then); in
	// bind mode that decides its addresses.
	split bool
	// refusing: bind mode closed the socket's listener because its traffic has no endpoint.
	refusing bool
	// filter checks clients of the port's load-balancer IPs against its source ranges (bind mode;
	// shared by the port's sockets).
	filter *sourceFilter
	// listen is where a socket reopened from the bind state listens, until the first sync
	// decides whether it keeps it (boundAdoptable).
	listen []netip.AddrPort
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
	if loglevel.Debug(d.log) { // the entry's fields cost 850 B a port at 10,000 ports
		d.portLog(port).WithField("proxyPort", proxyPort).Debug("Opened proxy socket")
	}
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
