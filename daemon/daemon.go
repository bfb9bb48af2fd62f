// Package daemon is the kube-portal-proxy node agent behind the command: its options and
// kube-proxy configuration file, the node tuning done at start, and the wiring of sources,
// proxier, portals and HTTP servers. New builds a Daemon without side effects; Run does the work.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/healthcheck"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe/auth"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/config"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// Daemon is the service proxy of one node. New builds it; Run serves until its context ends.
type Daemon struct {
	o       *Options
	version string
	log     logrus.FieldLogger
	deps    deps
	engine  tcp.Engine // --io-engine, resolved by Run
	// handoverFailed records the failed steps of this process's hand-overs, for the metrics.
	handoverFailed handoverFailures
}

// New builds the daemon for o with the real node, API client, portals and sockets. version names
// the build (startup line, API user agent). It opens nothing and starts nothing: Run does.
func New(o *Options, version string, log logrus.FieldLogger) *Daemon {
	return &Daemon{o: o, version: version, log: log, deps: systemDeps()}
}

// source is where Services and EndpointSlices come from.
type source interface {
	Run(ctx context.Context) error
}

// Run tunes the node, builds the portals, opens the HTTP servers and serves until ctx is done.
// Then it closes the proxy sockets and servers and waits, at most --shutdown-timeout, for every
// goroutine it started. Portal rules stay in place, so a restart does not black-hole services.
// An error means the daemon could not start or did not stop in time.
func (d *Daemon) Run(ctx context.Context) error {
	r := &run{d: d, o: d.o, log: d.log}
	defer r.exit()
	for _, step := range []func(context.Context) error{
		r.prepareHost,   // log the start, tune the process and node, check tools and privileges
		r.takeHandover,  // receive a running predecessor's sockets (--handover-socket)
		r.connect,       // the API client, unless --services-file
		r.findNodeIPs,   // from the interfaces (or, without any, the Node object)
		r.buildPortals,  // the event recorder and --portal-mode
		r.resolveSource, // --source-mode: the transparent plumbing, or why not
		r.pickEngine,    // --io-engine
		r.wire,          // balancer, proxier, source, metrics and HTTP handlers
		r.reopen,        // the ports the rules in force point at; the NAT probe of a fresh start
		r.restore,       // the restart snapshot or the predecessor's affinity; the Node so far
	} {
		if err := step(ctx); err != nil {
			return err
		}
	}
	tasks, err := r.tasks(ctx) // the proxier, sources, HTTP servers, hand-over, ready file
	if err != nil {
		return err
	}
	return runAll(ctx, d.deps.clock, d.o.shutdownTimeout, d.log, tasks...)
}

// afterClosed is a context that ends once ctx has ended and ch is closed.
func afterClosed(ctx context.Context, ch <-chan struct{}) context.Context {
	out, cancel := context.WithCancel(context.WithoutCancel(ctx))
	go func() { // ends with ctx and ch: the caller's task ends them
		defer cancel()
		<-ctx.Done()
		<-ch
	}()
	return out
}

// drainBudget is how long, after SIGTERM, a process that handed over lets its connections
// finish: most of --shutdown-timeout, keeping the rest for ending what is left.
func drainBudget(shutdownTimeout time.Duration) time.Duration { return shutdownTimeout * 3 / 4 }

// wiring is the daemon's pieces, connected: the proxier, its source, and the HTTP handlers.
type wiring struct {
	proxier   *proxier.Proxier
	balancer  *loadbalancer.LoadBalancer
	svcHealth *healthcheck.ServiceHealthServer
	health    *healthcheck.ProxyHealth
	source    source
	reload    func() // reloads the services file; nil in cluster mode
	restart   *restartStats
	snapshot  *snapshotStats
	gate      *handoverGate // fails /healthz while a hand-over is under way
	healthz   http.Handler
	metrics   http.Handler
	// metricsOnly serves --metrics-only-bind-address.
	metricsOnly http.Handler
	// hub is the live flow stream's ring, nil with --flow-ring-size=0; flows serves it on
	// --flows-bind-address, behind token authentication.
	hub   *observe.Hub
	flows http.Handler
}

// wire builds the balancer, proxier, source, metrics and HTTP handlers. It starts nothing.
func (d *Daemon) wire(client kubernetes.Interface, pm portalMode, events *serviceEvents, inh *handover.Inherited, settle func(), src *sourceSetup) (*wiring, error) {
	o := d.o
	syncMetrics := metrics.New()
	w := &wiring{balancer: loadbalancer.New(d.deps.clock), hub: newFlowHub(o, nodeName(o)), snapshot: newSnapshotStats()}
	w.health, w.svcHealth = d.healthChecks(events, inh)
	w.proxier = d.newProxier(hooksOf(pm), w, syncMetrics, events, inh, settle, src)
	events.uid = w.proxier.ServiceUID
	w.restart = &restartStats{reopened: w.proxier.ReopenCounts, failed: &d.handoverFailed}
	reg, err := d.registry(w, syncMetrics, pm, src)
	if err != nil {
		return nil, err
	}
	d.handlers(w, reg, pm, client, inh)
	w.source, w.reload = d.newSource(client, w.proxier)
	return w, nil
}

// healthChecks are the proxy's health (/healthz, /livez) and the service health check node
// ports, which listen on the predecessor's sockets where it handed them over.
func (d *Daemon) healthChecks(events *serviceEvents, inh *handover.Inherited) (*healthcheck.ProxyHealth, *healthcheck.ServiceHealthServer) {
	o, log := d.o, d.log
	health := healthcheck.NewProxyHealth(d.deps.clock, 2*o.syncPeriod)
	svcHealth := healthcheck.NewServiceHealthServer(healthcheck.ServiceConfig{
		NodePortAddresses: o.nodePorts, Proxier: health, Logger: log, Listen: healthListen(inh),
		OnListenError: func(svc service.NamespacedName, port uint16, err error) {
			log.WithFields(logrus.Fields{"service": svc.String(), "port": port}).WithError(err).Warn("Cannot open health check node port")
			events.ServiceWarning(svc, healthcheck.ReasonFailedToStart, err.Error())
		},
	})
	return health, svcHealth
}

// newProxier builds the proxier over w's balancer, health checks and flow hub, with what the
// portal mode gives (hooks) and the sockets of the chosen engine.
func (d *Daemon) newProxier(hooks proxierHooks, w *wiring, syncMetrics *metrics.Metrics, events *serviceEvents, inh *handover.Inherited, settle func(), src *sourceSetup) *proxier.Proxier {
	o, log := d.o, d.log
	var transparentPolicy flow.SourcePolicy // nil interface, not a nil *Policy
	if src.policy != nil {
		transparentPolicy = src.policy
	}
	pods := proxier.NewPodIndex() // the access log and the flow stream name the pod behind each endpoint
	return proxier.New(proxier.Config{
		ListenIP: o.bind, PortRange: o.portRange, KernelPorts: d.kernelPorts(hooks), MinSyncPeriod: o.minSyncPeriod, SyncPeriod: o.syncPeriod,
		DrainTCP: o.drainEndpoints, ListenPlan: hooks.plan, ListenState: hooks.listenState, Clock: d.deps.clock, Logger: log,
		Node: proxier.NodeTopology{Name: nodeName(o)}, AfterFirstSync: settle,
		KernelPath: o.portalMode == "iptables", DefaultDataPath: service.DataPath(o.defaultDataPath),
		SourceMode: src.mode, SourceWhy: src.why,
	}, proxier.Deps{
		Balancer: w.balancer, Portals: hooks.portals, Conntrack: hooks.conntrack,
		Metrics: syncMetrics, Health: w.health, ServiceHealth: w.svcHealth, Event: events.Warning, Pods: pods,
		KernelCounters: hooks.kernelCounters, Flows: flowSink(w.hub), // kernel-path flows only with KernelPath
		Sockets: proxier.RealSockets(proxier.AccessLog{All: o.accessLog, Log: log, Pods: pods}.SocketConfigs(proxier.SocketConfig{
			Flows: flowSink(w.hub), Node: nodeName(o), Transparent: transparentPolicy,
			TCP: tcp.Config{IdleTimeout: o.tcpIdleTimeout, Logger: log, FreeBind: hooks.freeBind, Adopt: adoptFrom(inh, "tcp"), Engine: d.engine},
			UDP: udp.Config{IdleTimeout: o.udpTimeout, MaxSessions: o.udpMaxSessions, Loops: udpLoops(o.udpLoops, o.portalMode, runtime.GOMAXPROCS(0)), Logger: log, FreeBind: hooks.freeBind, Adopt: adoptFrom(inh, "udp")},
		})),
	})
}

// kernelPorts reads the node's ephemeral port range, where proxy ports come from without
// --proxy-port-range, unless the sockets listen on the portal addresses (bind mode). Unreadable,
// the kernel chooses each proxy port.
func (d *Daemon) kernelPorts(hooks proxierHooks) proxier.KernelPorts {
	if !d.o.portRange.IsKernelChosen() || hooks.plan != nil || d.deps.kernelPorts == nil {
		return proxier.KernelPorts{}
	}
	kp, err := d.deps.kernelPorts()
	if err != nil {
		d.log.WithError(err).Warn("Cannot read the ephemeral port range; the kernel chooses proxy ports (slower with many service ports)")
	}
	return kp
}

// registry holds every metric but the traffic series (metrics.Handler adds those): the sync's,
// the process's, the restarts', the snapshot's, the engine's, the portal mode's and the flow
// stream's.
func (d *Daemon) registry(w *wiring, syncMetrics *metrics.Metrics, pm portalMode, src *sourceSetup) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	if err := syncMetrics.Register(reg); err != nil {
		return nil, fmt.Errorf("register metrics: %w", err)
	}
	cs := []prometheus.Collector{collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		w.restart.collector(), w.snapshot.collector(), engineCollector(d.engine), src.collector()}
	if mc, ok := pm.(metricsCollector); ok {
		cs = append(cs, mc.Collector())
	}
	if w.hub != nil {
		cs = append(cs, flowCollector(w.hub))
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	return reg, nil
}

// handlers sets w's HTTP handlers: /healthz and /livez, the metrics and debug pages, /metrics
// alone, and the flow stream (on the metrics address, and behind token authentication on
// --flows-bind-address).
func (d *Daemon) handlers(w *wiring, reg *prometheus.Registry, pm portalMode, client kubernetes.Interface, inh *handover.Inherited) {
	o := d.o
	var flows http.Handler // the flow stream; nil without a hub
	if w.hub != nil {
		flows = w.hub.Handler(w.proxier.FlowResolver())
		if o.flows.bindAddress != "" {
			w.flows = flowsMux(flows, auth.New(auth.Config{Client: client, Node: nodeName(o), Log: d.log}).Wrap)
		}
	}
	// A successor is not ready before it has taken over (see handoverGate).
	w.gate = &handoverGate{}
	w.gate.busy.Store(inh != nil)
	healthz := w.gate.wrap(engineHealthz(d.engine, w.health.Healthz()))
	w.healthz = healthMux(healthz, w.health.Livez())
	scrape := metrics.Handler(reg, w.proxier)
	w.metrics = metricsMux(scrape, healthz, w.proxier, pm.Describe, o.profiling, flows)
	w.metricsOnly = metricsOnlyMux(scrape)
}

// newSource is where the proxier's Services and EndpointSlices come from: --services-file (reload
// on SIGHUP), or the API server.
func (d *Daemon) newSource(client kubernetes.Interface, px *proxier.Proxier) (src source, reload func()) {
	if d.o.servicesFile != "" {
		fsrc := config.NewFileSource(d.o.servicesFile, px, d.deps.clock, d.o.fileCheckPeriod, d.log)
		return fsrc, fsrc.Reload
	}
	return config.NewInformerSource(client, d.o.configSyncPeriod, px, d.log), nil
}

// healthMux serves --healthz-bind-address: /healthz fails when syncs stall or the node is being
// deleted (so load balancers drain it), /livez only when syncs stall (KEP-3836: a node being
// drained must not get its proxy restarted, which would drop every proxied connection).
func healthMux(healthz, livez http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/healthz", healthz)
	mux.Handle("/livez", livez)
	return mux
}

// metricsMux serves --metrics-bind-address: metrics, the debug pages and, with --profiling,
// pprof (off by default as in kube-proxy: a profile costs CPU, and /debug/pprof/cmdline and the
// heap show the command line and memory to whoever reaches the address).
func metricsMux(scrape, health http.Handler, px *proxier.Proxier, rules func() string, profiling bool, flows http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", scrape)
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "userspace") })
	mux.Handle("/healthz", health)
	if profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	}
	debugview.Register(mux, px)
	if flows != nil {
		mux.Handle(flowsPath, flows)
	}
	mux.Handle("/debug/rules", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprint(w, rules())
	}))
	return mux
}

// metricsOnlyMux serves --metrics-only-bind-address: /metrics and nothing else, so the address
// can face Prometheus across the network without the debug pages (client addresses, live
// connections, the rules) or pprof.
func metricsOnlyMux(scrape http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", scrape)
	return mux
}

// runAll runs each task in its own goroutine until ctx is done, then waits for all of them, at
// most timeout.
func runAll(ctx context.Context, clk clock.Clock, timeout time.Duration, log logrus.FieldLogger, tasks ...func(context.Context)) error {
	var wg sync.WaitGroup
	for _, task := range tasks {
		wg.Go(func() { task(ctx) })
	}
	<-ctx.Done()
	log.Info("Shutting down; portal rules stay in place so a restart does not black-hole services")
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	timer := clk.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-done:
		return nil
	case <-timer.C():
		return fmt.Errorf("shutdown took longer than --shutdown-timeout=%v", timeout)
	}
}

// reloadOnSignal reloads the services file on SIGHUP until ctx is done.
func (d *Daemon) reloadOnSignal(reload func()) func(context.Context) {
	return func(ctx context.Context) {
		hup := make(chan os.Signal, 1)
		defer d.deps.notifyReload(hup)()
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				d.log.Info("SIGHUP: reloading the services file")
				reload()
			}
		}
	}
}

// iptablesTool names a tool of the chosen variant the way Debian installs them:
// iptables-nft-restore, iptables-legacy-save, ...
func iptablesTool(o *Options, tool string) string {
	if o.iptablesVariant == "" {
		return tool
	}
	return strings.Replace(tool, "iptables", "iptables-"+o.iptablesVariant, 1)
}

// newClient builds the API client from --kubeconfig and --master, or in-cluster.
func newClient(o *Options, version string) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if o.kubeconfig == "" && o.master == "" {
		cfg, err = rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("no --kubeconfig, --master or --services-file, and not in a cluster: %w", err)
		}
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags(o.master, o.kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("kubeconfig %q: %w", o.kubeconfig, err)
		}
	}
	cfg.QPS = o.apiQPS
	cfg.Burst = o.apiBurst
	cfg.UserAgent = "kube-portal-proxy/" + version
	// Protobuf, as kube-proxy asks for (--kube-api-content-type): the initial lists of 10,000
	// Services and EndpointSlices decode in a fraction of JSON's time. JSON stays accepted for
	// what the API server cannot send as protobuf.
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	return c, nil
}

// getNode reads this node's Node object. A missing Node is not fatal: the interfaces decide the
// node IPs then, and the zone is unknown until the watch sees the Node.
func getNode(ctx context.Context, c kubernetes.Interface, name string, log logrus.FieldLogger) *v1.Node {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	node, err := c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		log.WithError(err).WithField("node", name).Warn("Cannot read the Node object; node IPs come from the interfaces")
		return nil
	}
	return node
}

// nodeAddresses lists a Node's InternalIP and ExternalIP addresses (none for a nil Node).
func nodeAddresses(node *v1.Node) []netip.Addr {
	if node == nil {
		return nil
	}
	var out []netip.Addr
	for _, want := range []v1.NodeAddressType{v1.NodeInternalIP, v1.NodeExternalIP} {
		for _, a := range node.Status.Addresses {
			if a.Type == want {
				if ip, err := netip.ParseAddr(a.Address); err == nil {
					out = append(out, ip)
				}
			}
		}
	}
	return out
}

// Cleanup removes every chain and rule this proxy owns, for both families, and the bind mode's
// portal interface (--cleanup). Either may be absent: that is not an error.
func Cleanup(ctx context.Context, o *Options, log logrus.FieldLogger) error {
	var errs []error
	if _, err := exec.LookPath(iptablesTool(o, "iptables-restore")); err == nil {
		rules := iptables.New(iptables.Config{Logger: log}, &iptables.ExecRunner{Variant: o.iptablesVariant})
		errs = append(errs, rules.Cleanup(ctx))
		src := newSourceNode(o, log).(closingSourceNode)
		errs = append(errs, src.Cleanup(ctx)) // the transparent source mode's rules, routes, nft table
		_ = src.Close()
	} else {
		log.Info("No iptables on this node: no portal rules to remove")
	}
	nl := &bind.Netlink{}
	defer nl.Close()
	errs = append(errs, bind.New(bind.Config{Interface: o.portalInterface, Logger: log}, nl).Cleanup(ctx))
	return errors.Join(errs...)
}

// portalCollector exports the iptables portal counters, with kube-proxy's name for restore failures.
func portalCollector(rules *iptables.Portals) prometheus.Collector {
	failures := prometheus.NewDesc("kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
		"Cumulative proxy iptables restore failures", nil, nil)
	restores := prometheus.NewDesc("kube_portal_proxy_iptables_restores_total", "iptables-restore runs.", nil, nil)
	repairs := prometheus.NewDesc("kube_portal_proxy_iptables_repairs_total", "Syncs that found the live chains changed by someone else and rewrote them.", nil, nil)
	count := prometheus.NewDesc("kube_portal_proxy_portal_rules", "Portal rules programmed (all families and tables).", nil, nil)
	epLabels := []string{"service_port", "protocol", "endpoint"} // service_port as in every other series
	kpackets := prometheus.NewDesc("kube_portal_proxy_kernel_endpoint_packets_total",
		"Packets through the DNAT rule of a kernel-path endpoint's KUBE-SEP chain: the nat table sees the first packet of each connection (UDP flow) only, so this counts new connections.", epLabels, nil)
	kbytes := prometheus.NewDesc("kube_portal_proxy_kernel_endpoint_bytes_total",
		"Bytes of the packets counted by kube_portal_proxy_kernel_endpoint_packets_total.", epLabels, nil)
	return collectorFunc{descs: []*prometheus.Desc{failures, restores, repairs, count, kpackets, kbytes}, collect: func(ch chan<- prometheus.Metric) {
		// At most one iptables-save -c per family and CounterInterval, none without kernel ports.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		counters, _ := rules.KernelCounters(ctx)
		cancel()
		for _, c := range counters {
			labels := []string{c.Name.String(), string(c.Protocol), c.Endpoint.String()}
			ch <- prometheus.MustNewConstMetric(kpackets, prometheus.CounterValue, float64(c.Packets), labels...)
			ch <- prometheus.MustNewConstMetric(kbytes, prometheus.CounterValue, float64(c.Bytes), labels...)
		}
		st := rules.Stats()
		ch <- prometheus.MustNewConstMetric(failures, prometheus.CounterValue, float64(st.RestoreFailures))
		ch <- prometheus.MustNewConstMetric(restores, prometheus.CounterValue, float64(st.Restores))
		ch <- prometheus.MustNewConstMetric(repairs, prometheus.CounterValue, float64(st.Repairs))
		ch <- prometheus.MustNewConstMetric(count, prometheus.GaugeValue, float64(st.Rules))
	}}
}

type collectorFunc struct {
	descs   []*prometheus.Desc
	collect func(chan<- prometheus.Metric)
}

func (c collectorFunc) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c collectorFunc) Collect(ch chan<- prometheus.Metric) { c.collect(ch) }

// chooseEngine resolves --io-engine. With auto, a kernel or sandbox without io_uring (seccomp,
// kernel.io_uring_disabled, an old kernel) gets the epoll engine and one log line saying why.
func (d *Daemon) chooseEngine() (tcp.Engine, error) {
	e, fallback, err := tcp.ChooseEngine(d.o.ioEngine, d.deps.probeIOUring, d.log)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", d.o.setting("--io-engine"), err)
	}
	if fallback != nil {
		d.log.WithError(fallback).WithField("engine", e.Name()).Warn("io_uring is not available here: TCP uses the epoll engine")
	} else {
		d.log.WithField("engine", e.Name()).Info("TCP engine")
	}
	return e, nil
}

// engineStatus is what the metrics and /healthz read of the TCP engine (tcp.Engine).
type engineStatus interface {
	Name() string
	Status() tcp.EngineStatus
}

// engineCollector is kube_portal_proxy_io_engine{engine}, 1 for the engine serving new sockets
// (epoll once an io_uring engine has fallen back) and 0 for the other, and
// kube_portal_proxy_io_engine_failures_total{engine,phase}: the io_uring engine's failed starts
// and loops that died (tcp/fallback.go).
func engineCollector(e engineStatus) prometheus.Collector {
	inUse := prometheus.NewDesc("kube_portal_proxy_io_engine",
		"The engine that accepts TCP connections and moves their bytes (--io-engine): 1 for the one serving new sockets, 0 for an io_uring engine that fell back to epoll.", []string{"engine"}, nil)
	failures := prometheus.NewDesc("kube_portal_proxy_io_engine_failures_total",
		"Failures of the io_uring engine after the start-up probe, by phase: start (its rings could not be set up) or run (a loop's ring broke; its connections were reset). Either makes it serve on epoll.", []string{"engine", "phase"}, nil)
	return collectorFunc{descs: []*prometheus.Desc{inUse, failures}, collect: func(ch chan<- prometheus.Metric) {
		st := e.Status()
		ch <- prometheus.MustNewConstMetric(inUse, prometheus.GaugeValue, 1, st.Serving)
		if e.Name() != tcp.EngineIOUring {
			return
		}
		if st.Serving != e.Name() {
			ch <- prometheus.MustNewConstMetric(inUse, prometheus.GaugeValue, 0, e.Name())
		}
		ch <- prometheus.MustNewConstMetric(failures, prometheus.CounterValue, float64(st.StartFailures), e.Name(), tcp.PhaseStart)
		ch <- prometheus.MustNewConstMetric(failures, prometheus.CounterValue, float64(st.LoopFailures), e.Name(), tcp.PhaseRun)
	}}
}

// engineHealthz fails /healthz once the TCP engine reports an error (an io_uring loop died: its
// connections were reset, and the engine serves on epoll until the process restarts), and asks h
// otherwise. /livez stays with the proxier alone: the proxy serves, and a restart by the kubelet
// would drop every connection it still has.
func engineHealthz(e engineStatus, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := e.Status().Err; err != nil {
			http.Error(w, fmt.Sprintf("TCP engine %s degraded: %v", e.Name(), err), http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// udpLoops is the loops per UDP service port: --udp-loops when set, else two in bind mode on more
// than one CPU and one otherwise. Two loops won in bind mode on the quiet machine (bench/suite,
// 2026-11-26: 109,736 against 92,083 exchanges/s, 6.7 against 6.4 µs of CPU per exchange), and
// cost 7-35% more CPU per exchange at no better rate behind the iptables portal's REDIRECT
// (five loaded runs, bench/RESULTS.md).
func udpLoops(flag int, portalMode string, procs int) int {
	switch {
	case flag > 0:
		return flag
	case portalMode == "bind" && procs > 1:
		return 2
	default:
		return 1
	}
}
