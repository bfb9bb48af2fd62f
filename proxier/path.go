package proxier

// path.go: every service port this node serves takes one data path, and the proxier keeps them
// in one map (dataPaths.byName). Two paths exist: the proxy-socket path (activePort, sync.go: portal
// rules redirect to a proxy socket that picks an endpoint) and the kernel path (kernelPort,
// kernelpath.go: kube-proxy's chains DNAT straight to the endpoints). The sync picks a path per
// port (reconcileService), asks every path for its portal spec (specs), and a port that switches
// paths retires the old one only after a portal sync that worked (retirePaths), so no new
// connection is refused in between.

import (
	"cmp"
	"context"
	"fmt"
	"iter"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// dataPaths is every service port's data path, and what the sync needs to reconcile them: the
// sockets' proxy ports, the ports whose socket failed, the seeds of a restart (restart.go), the
// conntrack bookkeeping of UDP ports (kernelpath.go, untranslated.go). The sync goroutine owns
// it; mu guards byName for the readers outside it (debug views, drains, snapshots).
type dataPaths struct {
	// cfg and deps are the Proxier's.
	cfg  *Config
	deps *Deps
	log  logrus.FieldLogger
	eps  *endpointApplier

	mu     sync.RWMutex
	byName map[service.ServicePortName]portPath
	// kflows indexes the kernel-path ports by address for their conntrack flow events.
	kflows *kernelFlows

	// services is every Service's ports as the sync last applied them.
	services map[service.NamespacedName][]*service.Port
	// retiring are the paths ports left (the sockets of ports that moved to the kernel path,
	// kernel paths left), ended after the next portal sync that works (retirePaths).
	retiring []portPath
	// steered: what each UDP port's rules steered at the last sync that worked, and steerGen
	// that sync's number (clearUntranslated).
	steered  map[service.ServicePortName]*steered
	steerGen uint64
	// failed: ports whose socket failed to open, retried at every sync; extFailed: ports whose
	// external-traffic socket failed to open (logged once).
	failed    map[service.ServicePortName]*service.Port
	extFailed map[service.ServicePortName]bool
	// unsynced names the service ports whose portal spec changed (socket opened or closed)
	// since the last portal sync that worked, so a failed sync can say what it failed to apply.
	unsynced map[service.ServicePortName]struct{}
	ports    *portAllocator
	// listenChanged: a socket stopped or started refusing since the last saved listen state
	// (bind mode; Config.ListenState is given the state only after a sync that changed it).
	listenChanged bool
	// restart is the state of the sockets reopened at start (restart.go).
	restart reopenState
	// runCtx is the context the sockets run on (set by Run); socketWG tracks their goroutines.
	runCtx   context.Context
	socketWG sync.WaitGroup
}

// newDataPaths builds the paths of a Proxier (its cfg, deps and endpointsReady); the Proxier
// sets eps.
func newDataPaths(cfg *Config, deps *Deps, endpointsReady chan struct{}) *dataPaths {
	d := &dataPaths{
		cfg: cfg, deps: deps, log: cfg.Logger,
		byName:   make(map[service.ServicePortName]portPath),
		services: make(map[service.NamespacedName][]*service.Port),
		failed:   make(map[service.ServicePortName]*service.Port),
		ports:    newPortAllocator(cfg.PortRange, cfg.KernelPorts),
		restart: reopenState{endpointsReady: endpointsReady,
			seeded:   make(map[service.ServicePortName]bool),
			keepPort: make(map[service.ServicePortName]uint16),
		},
	}
	if deps.Flows != nil && cfg.KernelPath {
		d.kflows = newKernelFlows(deps.Flows, cfg.Node.Name)
	}
	return d
}

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
	retire(d *dataPaths)
}

var (
	_ portPath = (*activePort)(nil)
	_ portPath = (*kernelPort)(nil)
)

// socketOf is the proxy-socket path of a port, or nil when it has none (kernel path, socket
// failed, unknown). The caller holds d.mu.
func (d *dataPaths) socketOf(name service.ServicePortName) *activePort {
	a, _ := d.byName[name].(*activePort)
	return a
}

// socketPaths yields the ports on the proxy-socket path. The caller holds d.mu.
func (d *dataPaths) socketPaths() iter.Seq2[service.ServicePortName, *activePort] {
	return func(yield func(service.ServicePortName, *activePort) bool) {
		for name, path := range d.byName {
			if a, ok := path.(*activePort); ok && !yield(name, a) {
				return
			}
		}
	}
}

// specs lists the portal spec of every port's path, sorted by name for stable rule output.
func (d *dataPaths) specs() []portal.Spec {
	d.mu.RLock()
	d.eps.selMu.RLock()
	if d.kflows != nil && d.kflows.dirty {
		d.kflows.rebuild(d.kernelPorts())
	}
	out := make([]portal.Spec, 0, len(d.byName))
	for name, path := range d.byName {
		out = append(out, path.spec(d.eps.sels[name]))
	}
	d.eps.selMu.RUnlock()
	d.mu.RUnlock()
	slices.SortFunc(out, func(a, b portal.Spec) int {
		return cmp.Or(cmp.Compare(a.Name.Namespace, b.Name.Namespace), cmp.Compare(a.Name.Name, b.Name.Name),
			cmp.Compare(a.Name.Port, b.Name.Port))
	})
	return out
}

// retirePaths ends the paths that ports left, after a portal sync that worked: first the proxy
// sockets of ports that moved to the kernel path (activePort.retire: their UDP conntrack
// entries, then the socket), then the conntrack entries of kernel-path UDP ports that lost
// endpoints or left (clearStaleKernelUDP).
func (d *dataPaths) retirePaths(specs []portal.Spec) {
	if d.retiresUDPSocket() {
		// A datagram that took the old portal just before the sync is being answered through
		// the proxy socket now; deleting its conntrack entry mid-exchange would turn the answer
		// into one from the proxy's own address, which the client drops (the 30-minute soak
		// lost one answer in about 200 switches). Answers take milliseconds: let them finish.
		// New clients meanwhile take the kernel chains.
		var stop <-chan struct{}
		if d.runCtx != nil {
			stop = d.runCtx.Done()
		}
		t := time.NewTimer(udpRetireGrace)
		select {
		case <-t.C:
		case <-stop:
			t.Stop()
		}
	}
	for _, path := range d.retiring {
		path.retire(d)
	}
	d.clearStaleKernelUDP(specs)
	d.retiring = nil
}

// udpRetireGrace is how long a UDP proxy socket the kernel path replaced keeps its conntrack
// entries after the portal sync that put the kernel chains in force (retirePaths).
const udpRetireGrace = 150 * time.Millisecond

// retiresUDPSocket reports whether a UDP proxy socket is among the paths to retire, whose
// redirected conntrack entries are cleared.
func (d *dataPaths) retiresUDPSocket() bool {
	if d.deps.Conntrack == nil {
		return false
	}
	for _, path := range d.retiring {
		if a, ok := path.(*activePort); ok && a.port.Protocol == service.UDP {
			return true
		}
	}
	return false
}

// DataPathOf reports the data path a service port is on right now (for the debug views):
// kernel, proxy, or "" when the port is unknown or has no socket (failed).
func (p *Proxier) DataPathOf(name service.ServicePortName) service.DataPath {
	return p.paths.dataPathOf(name)
}

func (d *dataPaths) dataPathOf(name service.ServicePortName) service.DataPath {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if path, ok := d.byName[name]; ok {
		return path.dataPath()
	}
	return ""
}

// openSocket is the open proxy socket of a port's cluster (or, external, its external) traffic,
// or nil.
func (d *dataPaths) openSocket(name service.ServicePortName, external bool) ProxySocket {
	d.mu.RLock()
	defer d.mu.RUnlock()
	a := d.socketOf(name)
	if a != nil && external {
		a = a.ext
	}
	if a == nil {
		return nil
	}
	return a.sock
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
