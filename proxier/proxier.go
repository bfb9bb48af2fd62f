// Package proxier turns Services and EndpointSlices into proxy sockets, portal rules and
// load-balancer state, and keeps them in step: event handlers record changes, a bounded-frequency
// runner calls one sync that reconciles the desired state by diff.
package proxier

import (
	"context"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/healthcheck"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	flowstream "github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ProxySocket is one service port's proxy socket: a TCP listener or a UDP socket with its sessions.
type ProxySocket interface {
	// Listen opens the socket; port 0 lets the kernel choose. Addr then reports the bound address.
	Listen(addr netip.AddrPort) error
	Addr() netip.AddrPort
	// Run serves until ctx is done or Close is called.
	Run(ctx context.Context) error
	// Close stops serving new connections/sessions at once.
	Close() error
	// DropEndpoint ends the connections or sessions that use an endpoint that is gone.
	DropEndpoint(ep netip.AddrPort) int
}

// Picker is what a proxy socket asks for endpoints (a loadbalancer.Service).
type Picker interface {
	Next(client netip.Addr, reset bool) (netip.AddrPort, error)
}

// SocketFactory builds (without opening) the proxy socket for a service port. allow, if not nil,
// is the check of a client's address the socket makes before anything else (bind mode's
// loadBalancerSourceRanges on a socket listening on a load-balancer IP); nil admits every client.
type SocketFactory func(p *service.Port, picker Picker, allow func(client netip.Addr) bool) ProxySocket

// Config is the proxier's node-level configuration.
type Config struct {
	// ListenIP is --bind-address: the address proxy sockets listen on. Unspecified means all.
	ListenIP  netip.Addr
	PortRange PortRange
	// KernelPorts, if known, is where ports come from without a PortRange (see KernelPorts).
	KernelPorts KernelPorts
	// MinSyncPeriod and SyncPeriod bound how often rules are synced.
	MinSyncPeriod time.Duration
	SyncPeriod    time.Duration
	// DrainTCP ends established TCP connections to endpoints that were removed (UDP sessions to
	// removed endpoints always end, so the client's next datagram reaches a live endpoint), but
	// not those of an endpoint still serving while terminating, until it stops serving. A
	// Service's drain-timeout annotation overrides it (see drain.go).
	DrainTCP bool
	// DrainGrace is how long a TCP connection closed by its drain deadline has between the FINs
	// and the reset; 0 means DefaultDrainGrace.
	DrainGrace time.Duration
	// ListenPlan, if set, lists the addresses a service port's sockets listen on (bind mode: each
	// portal IP at the service port, node addresses at the node port). Nil means one socket on
	// ListenIP at a port from PortRange, for the portal rules to redirect to (iptables mode).
	ListenPlan func(p *service.Port) []netip.AddrPort
	// ListenState, if set, is given in bind mode (ListenPlan) after every sync that worked where
	// each service port's sockets listen, as seeds for Reopen in the next process (the daemon
	// keeps them in a state file). It runs in the sync goroutine.
	ListenState func([]Seed)
	// ReopenHold bounds how long a socket reopened at start (Reopen) holds a connection that
	// finds no endpoint before the initial endpoints are in; 0 means DefaultReopenHold.
	ReopenHold time.Duration
	// AfterFirstSync, if set, is called once, after the first sync that programmed every portal
	// and before its garbage is handed back to the OS (the daemon lowers the GC target there:
	// the start allocates far more than the steady state keeps).
	AfterFirstSync func()
	// KernelPath reports whether the portals can put a port on the kernel data path (iptables
	// mode; bind mode has no NAT). DefaultDataPath is the data path of a Service without the
	// data-path annotation ("" means proxy).
	KernelPath      bool
	DefaultDataPath service.DataPath
	// SourceMode is the address endpoints see by default: service.SourceTransparent where the
	// node's transparent plumbing is in place (portal/transparent), else the proxy's own ("" or
	// service.SourceProxy). SourceWhy says why not transparent, for the events of Services that
	// ask for it.
	SourceMode service.SourceMode
	SourceWhy  string
	// Node is this node's name and zone, for traffic policies and topology hints.
	Node   NodeTopology
	Clock  clock.Clock
	Logger logrus.FieldLogger
}

// Deps are the proxier's collaborators, each behind a narrow seam.
type Deps struct {
	Balancer *loadbalancer.LoadBalancer
	Sockets  SocketFactory
	Portals  portal.Portals
	// Conntrack clears UDP flows of removed service ports; nil when the portal mode uses no NAT.
	Conntrack conntrack.Interface
	Metrics   *metrics.Metrics
	// Health learns when changes wait and when a sync applied them (/healthz, /livez).
	Health HealthTracker
	// ServiceHealth, if set, serves the health check node ports of externalTrafficPolicy: Local
	// load balancers: it is told the ports after each sync and the local ready endpoints per
	// Service whenever they change.
	ServiceHealth ServiceHealth
	// Pods, if set, is kept up to date with the pods behind the endpoints of the ports whose
	// access log is on (AccessLog.Pods).
	Pods *PodIndex
	// KernelCounters, if set, reads the KUBE-SEP counters of the kernel-path ports for the debug
	// views (iptables.Portals.KernelCounters: cached, cheap).
	KernelCounters func(ctx context.Context) ([]portal.EndpointCounter, error)
	// Event, if set, reports what an operator must act on, against the Service (a Kubernetes
	// Warning event in cluster mode). Called once per new failure, not on every sync.
	Event func(name service.ServicePortName, reason, message string)
	// Flows, if set, is the live flow stream: it takes the flow events of the kernel-path ports
	// (from conntrack, through KernelFlows, when Config.KernelPath), and the balancer names each
	// endpoint's pod for the picks (the proxy sockets get their Recorders through
	// SocketConfig.Flows).
	Flows FlowSink
}

// HealthTracker is the proxier's side of the proxy health (a *healthcheck.ProxyHealth).
type HealthTracker interface {
	QueuedUpdate()
	Updated()
}

// ServiceHealth is the proxier's side of the health check node ports (a
// *healthcheck.ServiceHealthServer).
type ServiceHealth interface {
	SyncServices(map[service.NamespacedName]uint16)
	SyncEndpoints(map[service.NamespacedName]int)
}

// Proxier is the node proxy's control loop.
type Proxier struct {
	cfg    Config
	deps   Deps
	log    logrus.FieldLogger
	runner *boundedRunner

	svcChanges *serviceChangeTracker
	slices     *endpointSliceCache

	// mu guards what the event handlers write and the sync reads.
	mu              sync.Mutex
	latest          map[service.NamespacedName][]*service.Port
	servicesSynced  bool
	endpointsSynced bool
	// started and pendingTriggers serve the network programming latency: trigger times of
	// endpoint changes that also changed rules, observed once a sync put those in force.
	started         time.Time
	pendingTriggers []trigger
	node            NodeTopology

	annotations annotationWarnings

	// eps applies endpoint changes to the balancer (endpoints.go).
	eps *endpointApplier

	// paths is every service port's data path, reconciled by the sync (path.go).
	paths *dataPaths

	// endpointsReady is closed once the initial Services and EndpointSlices are in.
	endpointsReady chan struct{}
	readyOnce      sync.Once
	// firstSynced: the first portal sync worked (its garbage was handed back to the OS).
	firstSynced bool
	// handOff is set by HandOff (see handoff.go).
	handOff handOffState
	// firstSync is closed after the first portal sync that worked (FirstSync).
	firstSync     chan struct{}
	firstSyncOnce sync.Once
	// serving is closed once Run has reopened the seeds' sockets (Serving).
	serving chan struct{}
}

// New builds a proxier. It opens nothing and starts nothing: call Run.
func New(cfg Config, deps Deps) *Proxier {
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Logger == nil {
		cfg.Logger = logrus.StandardLogger()
	}
	if !cfg.ListenIP.IsValid() {
		cfg.ListenIP = netip.IPv4Unspecified()
	}
	if cfg.ReopenHold <= 0 {
		cfg.ReopenHold = DefaultReopenHold
	}
	if deps.Metrics == nil {
		deps.Metrics = metrics.New()
	}
	if deps.Health == nil {
		deps.Health = healthcheck.NewProxyHealth(cfg.Clock, 2*cfg.SyncPeriod)
	}
	p := &Proxier{
		cfg:            cfg,
		deps:           deps,
		log:            cfg.Logger,
		svcChanges:     newServiceChangeTracker(),
		slices:         newEndpointSliceCache(),
		latest:         make(map[service.NamespacedName][]*service.Port),
		started:        cfg.Clock.Now(),
		node:           cfg.Node,
		endpointsReady: make(chan struct{}),
		firstSync:      make(chan struct{}),
		serving:        make(chan struct{}),
	}
	p.paths = newDataPaths(&p.cfg, &p.deps, p.endpointsReady)
	p.eps = &endpointApplier{
		balancer: deps.Balancer, pods: deps.Pods, health: deps.ServiceHealth, slices: p.slices,
		clock: cfg.Clock, log: cfg.Logger, drainTCP: cfg.DrainTCP, drainGrace: cfg.DrainGrace, refs: deps.Flows != nil,
		ports: p.portsOf, socketOf: p.paths.openSocket, onKernel: p.cfg.onKernel, runCtx: func() context.Context { return p.paths.runCtx },
		sels: make(map[service.ServicePortName]*portSelection), hcLocal: make(map[service.NamespacedName]int),
	}
	p.paths.eps = p.eps
	p.runner = newBoundedRunner(p.sync, cfg.MinSyncPeriod, cfg.SyncPeriod, cfg.Clock, cfg.Logger)
	if deps.Balancer != nil {
		deps.Balancer.OnEjection(p.onEjection)
	}
	if deps.Pods != nil {
		deps.Pods.source = p.endpointsOf
	}
	return p
}

// KernelFlows finds the kernel-path port of a conntrack entry by its original destination
// (observe/conntrack.PortLookup); nil without Deps.Flows.
func (p *Proxier) KernelFlows() KernelFlowLookup {
	if p.paths.kflows == nil {
		return nil
	}
	return p.paths.kflows
}

// FlowResolver names the pods behind flows' addresses for the live flow stream
// (observe.Resolver), from this proxier's EndpointSlices.
func (p *Proxier) FlowResolver() flowstream.Resolver {
	return &flowResolver{pods: p.deps.Pods, all: p.allEndpoints, clock: p.cfg.Clock.Now}
}

// allEndpoints lists every service port's endpoints as the handlers last saw them.
func (p *Proxier) allEndpoints() map[service.ServicePortName][]service.Endpoint {
	p.mu.Lock()
	ports := make([]*service.Port, 0, len(p.latest))
	for _, sps := range p.latest {
		ports = append(ports, sps...)
	}
	p.mu.Unlock()
	out := make(map[service.ServicePortName][]service.Endpoint, len(ports))
	for _, port := range ports {
		out[port.Name] = endpointsFor(port, p.slices.get(port.Name.ServiceName()))
	}
	return out
}

// Run runs the sync loop until ctx is done, then closes every proxy socket and waits for their
// goroutines. Portal rules are left in place on purpose: a restarted proxy reopens its sockets and
// swaps the rules in one restore, so service traffic is never black-holed.
func (p *Proxier) Run(ctx context.Context) {
	// The sockets outlive the sync loop when the proxy hands over (HandOff): they finish their
	// connections first. Otherwise they end with it, as before.
	sockets, endSockets := context.WithCancel(context.WithoutCancel(ctx))
	defer endSockets()
	p.paths.runCtx = sockets
	p.deps.Health.QueuedUpdate()
	p.paths.reopen()
	close(p.serving)
	p.runner.Run(p.syncContext(ctx))
	p.drain()
	endSockets()
	p.shutdown()
}

func (p *Proxier) shutdown() {
	p.paths.mu.Lock()
	for _, path := range append(slices.Collect(maps.Values(p.paths.byName)), p.paths.retiring...) {
		for _, sock := range path.sockets() {
			if s, ok := sock.(shutdowner); ok {
				s.Shutdown() // the process is going away: end established connections too
			} else {
				_ = sock.Close()
			}
		}
	}
	p.paths.mu.Unlock()
	p.paths.socketWG.Wait()
	p.eps.drains.wg.Wait() // they stop on the run context
}

// Sync asks for a sync soon (bounded by the minimum sync period).
func (p *Proxier) Sync() { p.runner.Trigger() }

func (p *Proxier) initialized() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.servicesSynced && p.endpointsSynced
}
