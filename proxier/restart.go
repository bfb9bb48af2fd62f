package proxier

// restart.go: a restarted proxy (after SIGKILL, an OOM kill, a crash) finds the portal rules of
// the process before it still in force, pointing at proxy ports nobody listens on: every new
// connection to a service is refused until the new process has read every Service and synced. The
// proxier therefore reopens, first thing in Run, a socket on each proxy port the rules point at
// (Reopen), and its first sync adopts those sockets instead of opening new ones, so the rules
// need not change. Until the initial endpoints have arrived a reopened TCP socket holds the
// connections that find no endpoint, for a bounded time, rather than resetting them.

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// DefaultReopenHold bounds how long a reopened socket holds a connection that finds no endpoint
// before the initial endpoints have arrived. A client's connect already succeeded; it waits for its
// first byte of answer, well within any client timeout, and gets a reset (as it would have without
// the hold) if the endpoints are still not known by then.
const DefaultReopenHold = 5 * time.Second

// Seed is a service port's proxy socket as the portal rules in force point at it (read back from
// the kernel at start), or in bind mode as the previous process listened (its state file).
type Seed struct {
	Name     service.ServicePortName
	Protocol service.Protocol
	// ProxyPort is where the rules send the port's cluster traffic; ExternalProxyPort, when not
	// 0, where they send its external traffic (a port with a Local traffic policy). In bind mode
	// ProxyPort is the service port and ExternalProxyPort is not used.
	ProxyPort, ExternalProxyPort uint16
	// Families are the families the socket listens in (its portal addresses' families).
	Families []portal.Family

	// Bind mode (Config.ListenPlan) only: Listen is where the port's socket listened, External,
	// when not empty, where its separate external-traffic socket did. LoadBalancerIPs and
	// SourceRanges let the reopened sockets on load-balancer IPs check their clients.
	Listen, External []netip.AddrPort
	LoadBalancerIPs  []netip.Addr
	SourceRanges     []netip.Prefix
}

// reopenState is what the paths keep of a restart: the seeds, the sockets reopened from them
// until the first sync adopts or closes them, and the gate of reopened UDP sockets.
type reopenState struct {
	// seeds are the sockets Run reopens first (Reopen); seeded names the open ones until the first
	// sync adopts or closes them; keepPort is the proxy port a reopened socket that must be opened
	// again (its real port differs) keeps, so the rules need not change.
	seeds    []Seed
	seeded   map[service.ServicePortName]bool
	keepPort map[service.ServicePortName]uint16
	// reopened and reallocated count the seeds reopened on their proxy port, and those that
	// could not be (the first sync allocates another port): ReopenCounts.
	reopened, rebound, reallocated atomic.Int64
	// endpointsReady is the Proxier's, closed once the initial Services and EndpointSlices are
	// in; gate opens reopened UDP sockets (reopenGate).
	endpointsReady chan struct{}
	gate           chan struct{}
	gateOnce       sync.Once
}

// Reopen asks Run to reopen, before anything else, a socket on each seed's proxy ports (in bind
// mode, on each seed's addresses), so that the portal rules (the addresses) a previous process
// left in place lead somewhere again. Call it before Run.
func (p *Proxier) Reopen(seeds []Seed) {
	p.paths.restart.seeds = slices.Clone(seeds)
}

// reopen opens the seeds' sockets: on the proxy ports the portal rules point at (iptables mode)
// or on the addresses of the bind state file (bind mode). A port still in use is tried again for
// up to reopenInUseFor (the killed predecessor's socket going away); a seed whose sockets still
// cannot be opened (a port another process took since) is reported and left to the first sync. It runs in the sync
// goroutine, before the first sync.
func (d *dataPaths) reopen() {
	if len(d.restart.seeds) == 0 {
		return
	}
	open, what := d.reopenSteered, "the proxy sockets the portal rules in force point at"
	if d.cfg.ListenPlan != nil {
		open, what = d.reopenSeedBound, "the sockets of the bind state file"
	}
	start := d.cfg.Clock.Now()
	opened, rebound, inherited, busy := 0, 0, 0, 0
	var reboundNames []string // the first few service ports bound anew, for the log
	done := func(s Seed, a *activePort, err error) {
		if errors.Is(err, errOutsideRange) {
			d.seedLog(s).WithField("proxyPort", s.ProxyPort).Info("Not reopening a proxy port outside --proxy-port-range; the first sync allocates another")
			return
		}
		if err != nil {
			d.seedLog(s).WithError(err).Warn("Cannot reopen " + what + "; the first sync opens them")
			return
		}
		for _, sock := range []*activePort{a, a.ext} {
			if sock == nil {
				continue
			}
			for _, m := range members(sock.sock) {
				if ad, ok := m.(adopter); ok && ad.Adopted() {
					inherited++
				} else {
					rebound++
					if len(reboundNames) < 10 {
						reboundNames = append(reboundNames, s.Name.String())
					}
				}
			}
		}
		d.mu.Lock()
		d.byName[s.Name] = a
		d.mu.Unlock()
		d.restart.seeded[s.Name] = true
		opened++
	}
	// A seed whose address is still in use is tried again once the others are open: waiting
	// for it in turn (up to reopenInUseFor) held back every seed after it, at 10,000 ports up to
	// a second more of refusals for most of them.
	// The sockets open on several threads (restartparallel.go); what they opened is recorded
	// here, in the seeds' order, once all are open.
	type result struct {
		a   *activePort
		err error
	}
	results := make([]result, len(d.restart.seeds))
	forEachInNetns(len(d.restart.seeds), reopenWorkers(), func(i int) {
		s := d.restart.seeds[i]
		d.eps.applyRestored(s.Name) // the restart snapshot's endpoints, before the socket accepts
		a, err := open(s)
		results[i] = result{a, err}
	})
	firstPass := d.cfg.Clock.Since(start) // every seed tried once: all but those in use serve
	var inUse []Seed
	for i, s := range d.restart.seeds {
		if errors.Is(results[i].err, syscall.EADDRINUSE) {
			busy++
			inUse = append(inUse, s)
			continue
		}
		done(s, results[i].a, results[i].err)
	}
	for _, s := range inUse {
		a, err := d.reopenInUse(open, s, start)
		done(s, a, err)
	}
	d.restart.reopened.Store(int64(opened))
	d.restart.rebound.Store(int64(rebound))
	d.restart.reallocated.Store(int64(len(d.restart.seeds) - opened))
	d.log.WithFields(logrus.Fields{"reopened": opened, "inheritedSockets": inherited, "reboundSockets": rebound, "seeds": len(d.restart.seeds),
		"stillInUse": busy, "firstPass": firstPass.String(), "duration": d.cfg.Clock.Since(start).String()}).
		Info("Reopened " + what)
	if inherited > 0 && rebound > 0 {
		// A hand-over that left sockets out: a port the predecessor opened after it listed its
		// sockets, or one it could not send.
		d.log.WithFields(logrus.Fields{"count": rebound, "servicePorts": strings.Join(reboundNames, ",")}).
			Info("Bound proxy sockets anew that the running proxy did not hand over")
	}
	d.restart.seeds = nil
	d.eps.restore.mu.Lock()
	d.eps.restore.pending = nil // only seeds' ports were taken: none is left
	d.eps.restore.mu.Unlock()
}

// seedLog is the logger of what the reopen says about one seed: built only to log (at 10,000
// seeds, two loggers each cost more than the reopen's own bookkeeping).
func (d *dataPaths) seedLog(s Seed) logrus.FieldLogger {
	return d.log.WithFields(logrus.Fields{"service": s.Name.String(), "protocol": string(s.Protocol)})
}

// reopenInUseFor bounds how long reopen tries again a seed whose address is still in use. Just
// after a SIGKILL the killed process's sockets can outlive it briefly (the kernel tears an
// io_uring instance down, and closes the files it holds, after the process is gone): seen in
// bind mode as "address already in use" on the service IP, which then waited for the first sync.
const reopenInUseFor = time.Second

// reopenInUse opens a seed whose address was in use again, every 20 ms until reopenInUseFor
// after the reopen started. It returns the last error when the address stays taken.
func (d *dataPaths) reopenInUse(open func(Seed) (*activePort, error), s Seed, start time.Time) (*activePort, error) {
	for {
		t := d.cfg.Clock.NewTimer(20 * time.Millisecond)
		select {
		case <-t.C():
		case <-d.runCtx.Done():
			t.Stop()
			return nil, d.runCtx.Err()
		}
		a, err := open(s)
		if !errors.Is(err, syscall.EADDRINUSE) || d.cfg.Clock.Since(start) > reopenInUseFor {
			return a, err
		}
	}
}

// errOutsideRange: a seed's proxy port is outside --proxy-port-range.
var errOutsideRange = errors.New("proxy port outside --proxy-port-range")

// reopenSteered opens, in iptables mode, one seed's proxy port (and its external-traffic one) that
// the portal rules point at. An external port that cannot be reopened is reported and left to the
// first sync; the seed's cluster socket serves meanwhile.
func (d *dataPaths) reopenSteered(s Seed) (*activePort, error) {
	if !d.ports.take(s.ProxyPort) {
		return nil, errOutsideRange
	}
	port := s.port()
	port.SourceMode = d.cfg.defaultSourceMode() // the port's own, if it differs, comes with the first sync
	sock, err := d.listenFamilies(port, s.ProxyPort, d.holdingBuild(port, port.Name, nil))
	if err != nil {
		d.ports.release(s.ProxyPort)
		return nil, fmt.Errorf("proxy port %d: %w", s.ProxyPort, err)
	}
	a := d.serve(port, sock, s.ProxyPort)
	if s.ExternalProxyPort != 0 && d.ports.take(s.ExternalProxyPort) {
		ext, err := d.listenFamilies(port, s.ExternalProxyPort, d.holdingBuild(port, externalName(port.Name), nil))
		if err == nil {
			a.ext = d.serve(port, ext, s.ExternalProxyPort)
		} else {
			d.ports.release(s.ExternalProxyPort)
			d.seedLog(s).WithField("proxyPort", s.ExternalProxyPort).WithError(err).Warn("Cannot reopen the external-traffic proxy port the portal rules point at")
		}
	}
	return a, nil
}

// port is the service port a seed's socket is opened for until the first sync knows the real one:
// the name and protocol, and one unspecified address per family so the socket listens in those.
func (s Seed) port() *service.Port {
	port := &service.Port{Name: s.Name, Protocol: s.Protocol}
	for _, f := range s.Families {
		if f == portal.IPv6 {
			port.ClusterIPs = append(port.ClusterIPs, netip.IPv6Unspecified())
		} else {
			port.ClusterIPs = append(port.ClusterIPs, netip.IPv4Unspecified())
		}
	}
	if len(port.ClusterIPs) == 0 {
		port.ClusterIPs = []netip.Addr{netip.IPv4Unspecified()}
	}
	return port
}

// adoptable reports whether the first sync can keep a reopened socket for the real port: same
// protocol, same families to listen in, and no per-port socket option the seed could not know
// (the access log, PROXY protocol and hold annotations, a source mode other than the node's). Otherwise the socket is reopened on the
// same proxy port.
func (d *dataPaths) adoptable(a *activePort, port *service.Port) bool {
	same := d.restart.seeded[port.Name] && a.port.Protocol == port.Protocol && !port.AccessLog &&
		port.ProxyProtocol == "" && port.HoldTimeout == 0 && a.port.SourceMode == port.SourceMode
	if d.cfg.ListenPlan != nil {
		return same && d.boundAdoptable(a, port)
	}
	return same && slices.Equal(wildcards(a.port), wildcards(port))
}

// dropUnwantedSeeds closes, at the first sync, the reopened sockets of service ports that no
// longer exist. Their rules go with the sync's diff.
func (d *dataPaths) dropUnwantedSeeds() {
	for name := range d.restart.seeded {
		wanted := slices.ContainsFunc(d.services[name.ServiceName()], func(port *service.Port) bool { return port.Name == name })
		if !wanted {
			d.log.WithField("service", name.String()).Debug("Closing a reopened proxy socket: the service port is gone")
			d.stopPort(name, true)
		}
	}
	d.restart.seeded = map[service.ServicePortName]bool{}
}

// holdingBuild builds a reopened socket: TCP ones hold connections that find no endpoint until
// the initial endpoints are in. UDP sockets cannot hold (the pick happens on their event loop,
// which must not block), so they read nothing until then (udp.Gate): datagrams wait in the
// socket's queue, or after a hand-over go to the predecessor, which reads the same socket.
// In bind mode the sockets on load-balancer IPs check their clients against filter (allowFor);
// in iptables mode the rules check the source ranges.
func (d *dataPaths) holdingBuild(port *service.Port, key service.ServicePortName, filter *sourceFilter) func(netip.AddrPort) ProxySocket {
	return func(at netip.AddrPort) ProxySocket {
		var picker Picker = d.deps.Balancer.Service(key)
		if port.Protocol == service.TCP {
			picker = &holdPicker{next: picker, ready: d.restart.endpointsReady, done: d.runCtx.Done(), clock: d.cfg.Clock, hold: d.cfg.ReopenHold}
		} else {
			picker = &gatedPicker{next: picker, ready: d.restoredGate(key)}
		}
		return d.deps.Sockets(port, picker, d.allowFor(port, at, filter))
	}
}

// reopenGate is closed once the initial endpoints are in, or ReopenHold after the first call, or
// when Run ends: reopened UDP sockets start reading then.
func (d *dataPaths) reopenGate() <-chan struct{} {
	d.restart.gateOnce.Do(func() {
		d.restart.gate = make(chan struct{})
		t := d.cfg.Clock.NewTimer(d.cfg.ReopenHold)
		go func() {
			defer close(d.restart.gate)
			defer t.Stop()
			select {
			case <-d.restart.endpointsReady:
			case <-t.C():
			case <-d.runCtx.Done():
			}
		}()
	})
	return d.restart.gate
}

// gatedPicker is a reopened UDP socket's picker: a udp.Gate until the initial endpoints are in.
type gatedPicker struct {
	next  Picker
	ready <-chan struct{}
}

var (
	_ udp.Gate     = (*gatedPicker)(nil)
	_ udp.Observer = (*gatedPicker)(nil)
	_ tcp.Observer = (*holdPicker)(nil)

	_ flow.Explainer = (*holdPicker)(nil)
	_ flow.Explainer = (*gatedPicker)(nil)
)

func (g *gatedPicker) Ready() <-chan struct{} { return g.ready }

func (g *gatedPicker) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	return g.next.Next(client, reset)
}

// NextWhy passes the balancer's explanation of its pick on to the flow stream.
func (g *gatedPicker) NextWhy(client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	return nextWhy(g.next, client, reset)
}

// nextWhy asks p for a pick and why, when it explains itself (the balancer does).
func nextWhy(p Picker, client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	if x, ok := p.(flow.Explainer); ok {
		return x.NextWhy(client, reset)
	}
	ep, err := p.Next(client, reset)
	return ep, flow.Pick{}, err
}

// DialDone and FlowDone pass the outcomes on to the balancer (least connections, outliers).
func (g *gatedPicker) DialDone(ep netip.AddrPort, err error) { observe(g.next, ep, err) }

func (g *gatedPicker) FlowDone(ep netip.AddrPort, reset bool) { flowDone(g.next, ep, reset) }

func (h *holdPicker) DialDone(ep netip.AddrPort, err error) { observe(h.next, ep, err) }

func (h *holdPicker) FlowDone(ep netip.AddrPort, reset bool) { flowDone(h.next, ep, reset) }

func observe(p Picker, ep netip.AddrPort, err error) {
	if o, ok := p.(tcp.Observer); ok {
		o.DialDone(ep, err)
	}
}

func flowDone(p Picker, ep netip.AddrPort, reset bool) {
	if o, ok := p.(tcp.Observer); ok {
		o.FlowDone(ep, reset)
	}
}

// holdPicker waits, when its service port has no endpoint and the proxier has not yet received
// the initial Services and EndpointSlices, until they are in (or hold passes), then asks again.
// Once they are in it only passes picks through.
type holdPicker struct {
	next  Picker
	ready <-chan struct{}
	done  <-chan struct{}
	clock clock.Clock
	hold  time.Duration
}

func (h *holdPicker) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	ep, _, err := h.NextWhy(client, reset)
	return ep, err
}

// NextWhy is Next with the balancer's explanation of the pick, for the flow stream.
func (h *holdPicker) NextWhy(client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	ep, why, err := nextWhy(h.next, client, reset)
	if err == nil || !errors.Is(err, loadbalancer.ErrNoEndpoints) {
		return ep, why, err
	}
	select {
	case <-h.ready:
		// The lists may have landed between that pick and this check: ready is closed only
		// after every initial endpoint is in the balancer, so only a pick made after seeing it
		// closed tells (returning the first pick's error reset a connection held since before
		// the first sync: the 1-in-100 TestBindModeReopenWithRealSockets failure).
		return nextWhy(h.next, client, reset)
	default:
	}
	t := h.clock.NewTimer(h.hold)
	defer t.Stop()
	select {
	case <-h.ready:
		return nextWhy(h.next, client, reset)
	case <-t.C():
	case <-h.done:
	}
	return ep, why, err
}

// markEndpointsReady releases held connections: the initial Services and EndpointSlices are in.
func (p *Proxier) markEndpointsReady() {
	p.readyOnce.Do(func() {
		for _, name := range p.eps.dropRestored() { // before held connections pick again
			p.applyEndpoints(name)
		}
		close(p.endpointsReady)
	})
}
