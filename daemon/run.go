package daemon

// run.go: the steps of Daemon.Run, in the order it takes them. Each step reads what the steps
// before it left in run and adds its own part; what a step opens it hands to onExit, which Run
// closes in reverse order as it returns.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// run is one Run of the daemon: what its steps have built so far.
type run struct {
	d   *Daemon
	o   *Options
	log logrus.FieldLogger

	exits   []func() // onExit's, closed in reverse order as Run returns
	started time.Time
	steps   *startupSteps
	settle  func() // after the first sync: the steady state's GC target

	inh  *handover.Inherited // a predecessor's sockets; nil without a hand-over
	snap *readState          // the restart snapshot read at start; nil: none to use
	// restorePriority ends a successor's start at lowered CPU priority (lowerPriority); nil
	// without a hand-over.
	restorePriority func()
	node            string
	client          kubernetes.Interface // nil with --services-file

	notNode  []string // interfaces whose addresses are not node IPs (bind mode's portal link)
	hostIPs  map[portal.Family]netip.Addr
	nodeObj  *v1.Node // the Node, when read before the portals (no interface address)
	nodeRead bool

	events     *serviceEvents
	pm         portalMode
	source     *sourceSetup
	w          *wiring
	prober     natProber // nil: the mode does not NAT
	probeLater bool      // the --random-fully probe runs once the sockets serve
	target     nodeTarget
}

// onExit closes f as Run returns, before whatever the earlier steps opened.
func (r *run) onExit(f func()) { r.exits = append(r.exits, f) }

// exit closes what the steps opened, the latest first.
func (r *run) exit() {
	for i := len(r.exits) - 1; i >= 0; i-- {
		r.exits[i]()
	}
}

// prepareHost logs the start, tunes the process and the node, and checks that the tools and
// privileges the portals need are there.
func (r *run) prepareHost(context.Context) error {
	d, o := r.d, r.o
	r.log.WithFields(logrus.Fields{"version": d.version, "mode": "userspace", "portal": o.portalMode, "config": o.configFile,
		"flags": changedFlags(o.flags)}).Info("Starting kube-portal-proxy")
	logConfigNotes(r.log, o)
	r.settle = d.deps.host.tune(o, r.log)
	if err := d.deps.host.check(o); err != nil {
		return err
	}
	r.started = d.deps.clock.Now()
	r.steps = newStartupSteps(d.deps.clock, r.log)
	r.steps.done("tune and check")
	return nil
}

// takeHandover receives a running predecessor's sockets (--handover-socket).
func (r *run) takeHandover(ctx context.Context) error {
	r.inh = r.d.receiveHandover(ctx)
	if r.inh != nil {
		r.onExit(r.inh.Close) // what no one took; after Ready there is nothing left
		// The predecessor serves every connection until this process is ready: the rest of
		// the start must not take the CPU its data path needs.
		r.restorePriority = lowerPriority(r.log)
		r.onExit(r.restorePriority)
	}
	r.steps.done("hand-over")
	return nil
}

// connect builds the API client, unless the services come from a file.
func (r *run) connect(context.Context) error {
	r.node = nodeName(r.o)
	if r.o.servicesFile != "" {
		return nil
	}
	c, err := r.d.deps.client(r.o, r.d.version)
	if err != nil {
		return err
	}
	r.client = c
	return nil
}

// findNodeIPs takes the node IPs from the interfaces until the Node object is read, after the
// sockets serve (startup.go). Only a node without an interface address waits for the Node first.
func (r *run) findNodeIPs(ctx context.Context) error {
	o := r.o
	if o.portalMode == "bind" {
		r.notNode = append(r.notNode, o.portalInterface) // service IPs, left there by a previous process
	}
	r.hostIPs = proxier.NodeIPs(proxier.HostNodeIPSources(o.bind, nil, r.notNode...))
	if len(r.hostIPs) == 0 && o.bind.IsUnspecified() && r.client != nil {
		r.nodeObj, r.nodeRead = getNode(ctx, r.client, r.node, r.log), true
		r.hostIPs = proxier.NodeIPs(proxier.HostNodeIPSources(o.bind, nodeAddresses(r.nodeObj), r.notNode...))
		r.steps.done("Node object (no interface address)")
	}
	if len(r.hostIPs) == 0 && o.bind.IsUnspecified() {
		return errors.New("no node IP found (no global unicast address on any interface): set --bind-address")
	}
	r.log.WithField("nodeIPs", fmt.Sprint(r.hostIPs)).Info("Node IPs")
	return nil
}

// buildPortals starts the event recorder and builds the portal mode (--portal-mode).
func (r *run) buildPortals(ctx context.Context) error {
	var stopEvents func()
	r.events, stopEvents = newServiceEvents(ctx, r.client, r.node, r.log)
	r.onExit(stopEvents)
	pm, err := r.d.deps.portals(ctx, r.o, r.hostIPs, r.events, r.inh, r.log)
	if err != nil {
		return err
	}
	r.pm = pm
	r.onExit(func() { _ = pm.Close() })
	r.steps.done("portals")
	return nil
}

// resolveSource resolves --source-mode: the policy, on at once where a predecessor's plumbing is
// in place; the plumbing itself is installed and repaired by a serving task (sourceSetup.run).
func (r *run) resolveSource(ctx context.Context) error {
	var node sourceNode
	if r.d.deps.sourceNode != nil && r.o.sourceMode != string(service.SourceProxy) {
		node = r.d.deps.sourceNode(r.o, r.log)
		if c, ok := node.(io.Closer); ok {
			r.onExit(func() { _ = c.Close() })
		}
	}
	r.source = resolveSource(ctx, r.o, node, interfaceAddrs, r.log)
	r.steps.done("source mode")
	return nil
}

// pickEngine resolves --io-engine; the engine closes once runAll has shut the proxy sockets down.
func (r *run) pickEngine(context.Context) error {
	e, err := r.d.chooseEngine()
	if err != nil {
		return err
	}
	r.d.engine = e
	r.onExit(func() { _ = e.Close() })
	return nil
}

// wire connects the balancer, proxier, source, metrics and HTTP handlers (starting nothing).
func (r *run) wire(context.Context) error {
	w, err := r.d.wire(r.client, r.pm, r.events, r.inh, r.settle, r.source)
	if err != nil {
		return err
	}
	r.w = w
	r.steps.done("wiring")
	return nil
}

// reopen hands the proxier the ports the rules in force (the bind state) point at. A fresh start
// then probes NAT (a node that cannot NAT fails here); a restart's rules in force prove NAT works,
// so its --random-fully probe waits until the sockets serve (startSources).
func (r *run) reopen(ctx context.Context) error {
	r.snap = readSnapshot(r.o.restartSnapshot, r.node, r.inh != nil, r.d.deps.clock, r.log)
	if r.snap != nil {
		r.steps.done("read the restart snapshot")
	}
	var rulesInForce bool
	if seeds, ok := r.snapshotSeeds(); ok {
		// A previous process of this mode synced on this node and wrote the snapshot: the node
		// can NAT, and the rules it left point at these ports (but for changes of its last
		// second, which the first sync makes).
		r.w.proxier.Reopen(seeds)
		rulesInForce = true
		r.log.WithField("servicePorts", len(seeds)).Info("Reopening the proxy ports of the restart snapshot (the portal rules in force are not read back first)")
		r.steps.done("seeds from the restart snapshot")
	} else {
		rulesInForce = seedReopen(ctx, r.pm, r.w.proxier, r.log)
		r.steps.done("read the rules in force (or the bind state)")
	}
	r.prober, _ = r.pm.(natProber)
	if r.prober == nil {
		return nil
	}
	if rulesInForce {
		r.probeLater = true
		return nil
	}
	if err := r.prober.ProbeNAT(ctx, false); err != nil {
		return err
	}
	r.steps.done("iptables probes")
	return nil
}

// snapshotSeeds are the restart snapshot's proxy ports as the reopen's seeds, when they can stand
// for the rules in force (see snapshotSeeds in restart.go): iptables mode only.
func (r *run) snapshotSeeds() ([]proxier.Seed, bool) {
	if r.snap == nil {
		return nil, false
	}
	if _, steered := r.pm.(steeredReader); !steered {
		return nil, false
	}
	if _, bound := r.pm.(listenPlanner); bound {
		return nil, false
	}
	fams := slices.Sorted(maps.Keys(r.hostIPs))
	_, err := net.InterfaceByName(r.o.portalInterface)
	return snapshotSeeds(r.snap.st, fams, proxyPortRange(r.o.portRange), err == nil)
}

// restore brings back the restart snapshot or the predecessor's affinity, and tells the proxier,
// health check and portals what is known of the Node so far.
func (r *run) restore(context.Context) error {
	d, w := r.d, r.w
	applySnapshot(r.snap, w.proxier, w.snapshot, d.deps.clock, r.log)
	inheritAffinity(r.inh, w.proxier, d.deps.clock, r.log)
	r.steps.done("restart snapshot or the predecessor's affinity")
	var setHostIPs func(map[portal.Family]netip.Addr) // nil: the mode has no rules to the node IPs
	if s, ok := r.pm.(hostIPSetter); ok {
		setHostIPs = s.SetHostIPs
	}
	r.target = nodeTarget{health: w.health, proxier: w.proxier, source: r.source,
		ips: &nodeIPs{bind: r.o.bind, exclude: r.notNode, set: setHostIPs, sync: syncAfterFirst(w.proxier), log: r.log, cur: r.hostIPs}}
	r.target.apply(r.node, r.nodeObj) // a Node read above: the zone is known before the first sync
	return nil
}

// tasks are what runs until ctx is done: the proxier first, then the serving tasks, the
// hand-over and the ready file. The serving tasks run under a context that ends with ctx, or
// earlier when this process hands over to a successor: then everything but the proxy sockets'
// draining stops.
func (r *run) tasks(ctx context.Context) ([]func(context.Context), error) {
	serving, stopServing := context.WithCancel(ctx)
	r.onExit(stopServing)
	servingTasks, err := r.servingTasks()
	if err != nil {
		return nil, err
	}
	proxierTask := r.w.proxier.Run
	var tasks []func(context.Context) // the proxier's task goes first, below
	for _, task := range servingTasks {
		tasks = append(tasks, func(context.Context) { task(serving) })
	}
	serves := r.w.proxier.FirstSync() // closed once this process serves
	if r.o.handoverSocket != "" {
		var handoverTask func(context.Context)
		proxierTask, handoverTask, serves = r.handOverTasks(ctx, stopServing)
		tasks = append(tasks, handoverTask)
	}
	if r.o.readyFile != "" {
		tasks = append(tasks, readyFileTask(r.o.readyFile, serves, r.log))
	}
	if r.restorePriority != nil {
		tasks = append(tasks, restoreWhenReady(serves, r.restorePriority))
	}
	return append([]func(context.Context){proxierTask}, tasks...), nil
}

// servingTasks are the tasks that stop when this process hands over: the service health checks,
// the sources, the start's milestones, the reload signal, the Node watch, the bind state writer,
// the kernel path's flows, the restart snapshot and the HTTP servers.
func (r *run) servingTasks() ([]func(context.Context), error) {
	o, w := r.o, r.w
	tasks := []func(context.Context){w.svcHealth.Run, r.startSources, r.logMilestones}
	if w.reload != nil {
		tasks = append(tasks, r.d.reloadOnSignal(w.reload))
	}
	if r.client != nil {
		tasks = append(tasks, watchNode(r.client, r.node, o.configSyncPeriod, r.target, r.log))
	}
	if k, ok := r.pm.(listenStateKeeper); ok {
		tasks = append(tasks, k.ListenState().Run)
	}
	if look := w.proxier.KernelFlows(); look != nil {
		tasks = append(tasks, kernelFlowsTask(look, r.log))
	}
	if r.source.node != nil {
		tasks = append(tasks, func(ctx context.Context) { r.source.run(ctx, interfaceAddrs) })
	}
	if o.restartSnapshot != "" {
		sw := &snapshotWriter{path: o.restartSnapshot, node: r.node, src: w.proxier, clock: r.d.deps.clock, period: snapshotPeriod, activityPeriod: snapshotActivityPeriod, stats: w.snapshot, log: r.log}
		tasks = append(tasks, sw.Run)
	}
	servers, err := r.d.listenHTTP([]httpServer{{o.healthzBindAddress, w.healthz, true}, {o.metricsBindAddress, w.metrics, false},
		{o.metricsOnlyBindAddress, w.metricsOnly, true}, {o.flows.bindAddress, w.flows, false}}, r.inh)
	if err != nil {
		return nil, err
	}
	return append(tasks, servers...), nil
}

// restoreWhenReady gives a successor its CPU priority back once it serves (it told its
// predecessor it is ready, or could not), or when the process stops.
func restoreWhenReady(serves <-chan struct{}, restore func()) func(context.Context) {
	return func(ctx context.Context) {
		select {
		case <-serves:
		case <-ctx.Done():
		}
		restore()
	}
}

// startSources runs, once the reopen in proxier.Run serves (sourcesAfterServing), what waits
// for the node: the --random-fully probe of a restart, the Node object, then the sources until
// ctx is done. The Node comes before the sources so that the first sync has its addresses and
// zone (an unreachable API server costs the first sync the read's timeout, as it did when the
// read came first, but not the reopened sockets).
func (r *run) startSources(ctx context.Context) {
	if !sourcesAfterServing(ctx, r.inh != nil, r.w.proxier.Serving()) {
		return
	}
	r.steps.done("waited for the reopen before the sources")
	if r.probeLater {
		_ = r.prober.ProbeNAT(ctx, true) // NAT proven: no error to report
		r.steps.done("iptables probe (--random-fully)")
	}
	if r.client != nil && !r.nodeRead {
		r.target.apply(r.node, getNode(ctx, r.client, r.node, r.log))
		r.steps.done("Node object")
	}
	if err := r.w.source.Run(ctx); err != nil && ctx.Err() == nil {
		r.log.WithError(err).Error("Source stopped")
	}
}

// logMilestones logs the end of the start's critical path (the sockets serve) and the first sync.
func (r *run) logMilestones(ctx context.Context) {
	select {
	case <-r.w.proxier.Serving():
		r.steps.serving()
	case <-ctx.Done():
		return
	}
	select {
	case <-r.w.proxier.FirstSync():
		r.steps.done("first sync")
	case <-ctx.Done():
	}
}

// handOverTasks are, with --handover-socket, the proxier's task and the hand-over task, and the
// channel closed once this process serves (a successor serves once it has taken over). At a
// SIGTERM the proxier drains its connections if this process handed over, or ends them. The
// hand-over task decides which as it stops (a successor's ready may be read just then), so the
// proxier sees the SIGTERM only once that task has returned.
func (r *run) handOverTasks(ctx context.Context, stopServing func()) (proxierTask, handoverTask func(context.Context), serves <-chan struct{}) {
	d, w, clk := r.d, r.w, r.d.deps.clock
	drain, endDrain := drainContext(ctx, clk, drainBudget(r.o.shutdownTimeout))
	r.onExit(endDrain)
	tookOver := make(chan struct{})
	handover := d.handoverTask(r.inh, w.proxier, affinityTable(w.balancer, clk), w.restart, w.gate, tookOver, r.started, func() {
		w.restart.handedOffAt.Store(clk.Now().UnixNano())
		w.proxier.HandOff(drain)
		stopServing()
		r.log.Info("Handed over to a successor: no longer syncing or accepting; finishing established connections, exiting at SIGTERM")
	})
	decided := make(chan struct{})
	proxierTask = func(ctx context.Context) { w.proxier.Run(afterClosed(ctx, decided)) }
	if r.inh != nil {
		// A successor reopens the inherited sockets (and accepts on them beside its
		// predecessor) only once its endpoints are in: before, it could only hold a connection
		// the predecessor would have answered at once (a second or more at 10,000 ports).
		proxierTask = func(ctx context.Context) {
			select {
			case <-w.proxier.EndpointsReady():
				r.steps.done("initial lists (a successor reopens only now)")
			case <-ctx.Done():
				return
			}
			w.proxier.Run(afterClosed(ctx, decided))
		}
	}
	handoverTask = func(ctx context.Context) {
		defer close(decided)
		handover(ctx)
	}
	return proxierTask, handoverTask, tookOver
}
