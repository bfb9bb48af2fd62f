package daemon

// handover.go: a planned restart (a DaemonSet rolling update with surge, a restart by hand) in
// which no client is refused. The new process, started while the old one runs, first asks it for
// its listening sockets over --handover-socket (package handover) and takes them wherever it
// would bind (proxy sockets, held node ports, health check node ports, the health and metrics
// listeners). Once its first sync is done it tells the old process, which stops syncing and
// accepting, finishes its connections, and exits at SIGTERM. Nothing is bound twice, so nothing
// fails with "address already in use", and the kernel's queues always have an owner.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// bindRetryFor bounds how long a start whose hand-over failed retries binding an HTTP address the
// running process still holds (see bindWhenFree). Past it the address stays unserved: the
// liveness probe then fails and the kubelet restarts this process, which binds it at last.
const bindRetryFor = 2 * time.Minute

// receiveHandover takes over the running proxy's sockets, if --handover-socket is set and a proxy
// answers there. nil means a normal start (no predecessor, or the hand-over failed: logged).
func (d *Daemon) receiveHandover(ctx context.Context) *handover.Inherited {
	path := d.o.handoverSocket
	if path == "" {
		return nil
	}
	log := d.log.WithField("socket", path)
	in, err := handover.Receive(ctx, path, handover.DefaultTimeout)
	switch {
	case errors.Is(err, handover.ErrNoPredecessor):
		log.Info("No running proxy to take over from")
		return nil
	case err != nil:
		d.handoverFailed.receive.Store(true)
		log.WithError(err).Warn("Taking over from the running proxy failed; starting without its sockets (binding, retried while it still holds them)")
		return nil
	}
	log.WithFields(logrus.Fields{"sockets": in.Received(), "duration": in.Duration().String()}).
		Info("Received the running proxy's listening sockets")
	return in
}

// adoptFrom is the proxy sockets' Adopt for one protocol: the inherited socket bound to the
// address, if any. nil without a hand-over.
func adoptFrom(in *handover.Inherited, proto string) func(netip.AddrPort) (int, bool) {
	if in == nil {
		return nil
	}
	return func(a netip.AddrPort) (int, bool) { return in.TakeFD(proto, a) }
}

// holdListen holds a node port (or a local portal IP's port) on the inherited socket if there is
// one, else binds it.
func holdListen(in *handover.Inherited) func(service.Protocol, netip.AddrPort) (io.Closer, error) {
	return func(proto service.Protocol, addr netip.AddrPort) (io.Closer, error) {
		hostport := ":" + strconv.Itoa(int(addr.Port()))
		if addr.Addr().IsValid() {
			hostport = addr.String()
		}
		if proto == service.UDP {
			if pc, ok := in.PacketConn("udp", hostport); ok {
				return pc, nil
			}
		} else if ln, ok := in.Listener("tcp", hostport); ok {
			return ln, nil
		}
		return portal.ListenHold(proto, addr)
	}
}

// healthListen opens a health check node port on the inherited socket if there is one.
func healthListen(in *handover.Inherited) func(ctx context.Context, network, address string) (net.Listener, error) {
	return func(ctx context.Context, network, address string) (net.Listener, error) {
		if ln, ok := in.Listener(network, address); ok {
			return ln, nil
		}
		var lc net.ListenConfig
		return lc.Listen(ctx, network, address)
	}
}

// bindWhenFree binds addr once the process holding it lets go, trying every 100 ms for at most
// bindRetryFor or until ctx ends. A start whose hand-over failed (or whose predecessor cannot hand
// over: an older version) finds the health and metrics addresses still held by the running proxy,
// which lets go only when it exits, and it exits only once this process is ready, which its
// readiness probe, answered meanwhile by the old process, says soon. So the start goes on and the
// address is served when it is free.
func (d *Daemon) bindWhenFree(ctx context.Context, addr string) (net.Listener, error) {
	deadline := d.deps.clock.Now().Add(bindRetryFor)
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-d.deps.clock.After(100 * time.Millisecond):
		}
		ln, err := d.deps.listen(addr)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || d.deps.clock.Now().After(deadline) {
			return ln, err
		}
	}
}

// inUseByPredecessor reports whether a bind failed because the address is in use while a
// hand-over is configured: then the running proxy probably holds it.
func (d *Daemon) inUseByPredecessor(err error) bool {
	return d.o.handoverSocket != "" && errors.Is(err, syscall.EADDRINUSE)
}

// restartStats is what the last start took over, for the metrics.
type restartStats struct {
	inherited   atomic.Int64 // sockets taken from the predecessor
	handover    atomic.Int64 // nanoseconds from asking for the sockets to telling it we are ready
	reopened    func() (reopened, reboundSockets, reallocated int)
	handedOffAt atomic.Int64 // unix nanoseconds this process handed over to a successor; 0: not
	failed      *handoverFailures
}

// handoverFailures are the steps of a hand-over that failed in this process. Each is set once and
// stays set: the process started without its predecessor's sockets (receive), or took them but
// could not tell it to stop accepting (ready), or cannot hand over to its own successor (listen).
// A failed hand-over is not fatal (the start binds anew), so only the metric and the log say it.
type handoverFailures struct{ receive, ready, listen atomic.Bool }

func (s *restartStats) collector() prometheus.Collector {
	socks := prometheus.NewDesc("kube_portal_proxy_restart_sockets",
		"Listening sockets this process took over at start: inherited, handed over by the running proxy; rebound, proxy sockets bound anew on the proxy ports the portal rules in force point at (their process was gone: SIGKILL, crash).",
		[]string{"origin"}, nil)
	ports := prometheus.NewDesc("kube_portal_proxy_restart_service_ports",
		"Service ports found in the portal rules in force at start: reopened on the proxy port the rules point at (inherited or rebound), or reallocated (that port could not be had; the first sync gave another).",
		[]string{"result"}, nil)
	dur := prometheus.NewDesc("kube_portal_proxy_handover_duration_seconds",
		"How long taking over from the running proxy took, from asking for its sockets to telling it this process serves (0 without a hand-over).", nil, nil)
	handedOff := prometheus.NewDesc("kube_portal_proxy_handed_over",
		"1 once this process has handed its sockets to a successor and only finishes its connections.", nil, nil)
	failed := prometheus.NewDesc("kube_portal_proxy_handover_failed",
		"1 if a step of a hand-over failed in this process: receive (it started without the running proxy's sockets: connections were refused while it bound anew), ready (it could not tell the running proxy to stop accepting), listen (it cannot hand over to its successor: the next update binds anew).",
		[]string{"step"}, nil)
	return collectorFunc{descs: []*prometheus.Desc{socks, ports, dur, handedOff, failed}, collect: func(ch chan<- prometheus.Metric) {
		reopened, rebound, reallocated := s.reopened()
		ch <- prometheus.MustNewConstMetric(socks, prometheus.GaugeValue, float64(s.inherited.Load()), "inherited")
		ch <- prometheus.MustNewConstMetric(socks, prometheus.GaugeValue, float64(rebound), "rebound")
		ch <- prometheus.MustNewConstMetric(ports, prometheus.GaugeValue, float64(reopened), "reopened")
		ch <- prometheus.MustNewConstMetric(ports, prometheus.GaugeValue, float64(reallocated), "reallocated")
		ch <- prometheus.MustNewConstMetric(dur, prometheus.GaugeValue, time.Duration(s.handover.Load()).Seconds())
		v := boolFloat(s.handedOffAt.Load() != 0)
		ch <- prometheus.MustNewConstMetric(handedOff, prometheus.GaugeValue, v)
		for _, step := range []struct {
			name string
			bit  *atomic.Bool
		}{{"receive", &s.failed.receive}, {"ready", &s.failed.ready}, {"listen", &s.failed.listen}} {
			ch <- prometheus.MustNewConstMetric(failed, prometheus.GaugeValue, boolFloat(step.bit.Load()), step.name)
		}
	}}
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// handoverGate fails /healthz (the readiness probe) while two processes accept on the same
// health listener: from the moment a successor has the sockets until it is ready. The kubelet
// probes the old and the new pod at the same host address, and either process may accept a
// probe; were the old one to answer "ready" for the new pod, the DaemonSet controller would
// delete the old pod (SIGTERM) before the new one has synced and taken over. Both processes
// answer "not ready" meanwhile, so the new pod turns Ready only once the old one has stopped
// accepting and the new one answers alone. /livez is left alone: a failed liveness probe
// restarts a container.
type handoverGate struct{ busy atomic.Bool }

// wrap answers 503 while a hand-over is under way, h otherwise.
func (g *handoverGate) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.busy.Load() {
			http.Error(w, "hand-over in progress: not ready", http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// readyFileTask creates path (--ready-file) once serves is closed, and removes it when ctx ends.
// The kubelet's HTTP probes of the old and the new pod of an update reach whichever process
// accepts on the shared health port, and its first probe of the new pod comes before the new
// process has even asked for the sockets: only something in the new container's own filesystem
// tells about the new process alone (the DaemonSet's startupProbe: test -e).
func readyFileTask(path string, serves <-chan struct{}, log logrus.FieldLogger) func(context.Context) {
	return func(ctx context.Context) {
		select {
		case <-serves:
		case <-ctx.Done():
			return
		}
		if err := os.WriteFile(path, []byte("serving\n"), 0o644); err != nil {
			log.WithError(fmt.Errorf("ready file %s: %w", path, err)).Error("Cannot create the ready file; a startup probe that tests for it fails")
			return
		}
		<-ctx.Done()
		_ = os.Remove(path)
	}
}

// handoverTask waits for the first sync, takes the --handover-socket path over, tells the
// predecessor (if any) that this process serves now, then answers a successor's request (handing
// it the sockets and the affinity table) until ctx ends; handedOff runs when a successor is ready. The path is taken before ready is sent, so
// the predecessor, which removes the socket file at exit only while it is its own, never removes
// this process's.
func (d *Daemon) handoverTask(in *handover.Inherited, px *proxier.Proxier, affinity func() []handover.AffinityEntry, stats *restartStats, gate *handoverGate, tookOver chan<- struct{}, started time.Time, handedOff func()) func(context.Context) {
	return func(ctx context.Context) {
		select {
		case <-px.FirstSync():
		case <-ctx.Done():
			if in != nil {
				in.Close() // the predecessor goes on serving
			}
			return
		}
		// A SIGTERM before the successor is ready waits up to 3/4 of the drain budget for it,
		// serving meanwhile. The drain's deadline counts from the SIGTERM either way, so the
		// connections open then lose nothing; those accepted while waiting keep at least a
		// quarter of it.
		srv := handover.NewServer(handover.ServerConfig{Path: d.o.handoverSocket, Logger: d.log, Clock: d.deps.clock, Pending: gate.busy.Store, Affinity: affinity,
			StopWait: drainBudget(d.o.shutdownTimeout) * 3 / 4})
		listenErr := srv.Listen()
		if in != nil {
			taken := in.Taken()
			unclaimed, err := in.Ready()
			gate.busy.Store(false) // the predecessor stops accepting now (or is gone)
			took := d.deps.clock.Since(started)
			stats.inherited.Store(int64(taken))
			stats.handover.Store(int64(took))
			reopened, rebound, reallocated := px.ReopenCounts()
			log := d.log.WithFields(logrus.Fields{"inherited": taken, "received": in.Received(), "closedUnused": len(unclaimed),
				"reopened": reopened, "rebound": rebound, "reallocated": reallocated, "transfer": in.Duration().String(), "duration": took.String()})
			if len(unclaimed) > 0 {
				d.log.WithField("sockets", strings.Join(unclaimed, " ")).Info("Closed the inherited sockets this process does not serve")
			}
			if err != nil {
				stats.failed.ready.Store(true)
				log.WithError(err).Warn("Took over the running proxy's sockets, but could not tell it; it stops at its SIGTERM")
			} else {
				log.Info("Took over from the running proxy")
			}
		}
		close(tookOver)
		if listenErr != nil {
			stats.failed.listen.Store(true)
			d.log.WithError(listenErr).Error("Cannot listen on the hand-over socket; a successor will have to bind anew")
			return
		}
		srv.Run(ctx, handedOff)
	}
}

// drainContext ends budget after ctx ends (or when cancelled): how long a process that handed
// over lets its connections finish once it is told to stop.
func drainContext(ctx context.Context, clk clock.Clock, budget time.Duration) (context.Context, context.CancelFunc) {
	drain, cancel := context.WithCancel(context.WithoutCancel(ctx))
	go func() {
		select {
		case <-drain.Done():
			return
		case <-ctx.Done():
		}
		t := clk.NewTimer(budget)
		defer t.Stop()
		select {
		case <-t.C():
			cancel()
		case <-drain.Done():
		}
	}()
	return drain, cancel
}

// affinityTable lists the balancer's ClientIP affinity entries for a successor (a planned restart
// keeps clients on their endpoints), with how long each has been idle.
func affinityTable(lb *loadbalancer.LoadBalancer, clk clock.PassiveClock) func() []handover.AffinityEntry {
	return func() []handover.AffinityEntry {
		now := clk.Now()
		var out []handover.AffinityEntry
		for _, name := range lb.Names() {
			s := lb.Lookup(name)
			if s == nil || !s.Affinity().ClientIP {
				continue
			}
			for _, e := range s.AffinityEntries() {
				out = append(out, handover.AffinityEntry{Service: name, Client: e.Client, Endpoint: e.Endpoint, Idle: max(now.Sub(e.LastUsed), 0)})
			}
		}
		return out
	}
}

// inheritAffinity gives the proxier the predecessor's affinity table (none from an older build
// or without ClientIP clients), and logs what was dropped on receipt.
func inheritAffinity(in *handover.Inherited, px *proxier.Proxier, clk clock.PassiveClock, log logrus.FieldLogger) {
	if in == nil {
		return
	}
	if n, why := in.AffinityDropped(); n > 0 {
		log.WithError(why).WithField("dropped", n).Warn("Dropped ClientIP affinity entries of the hand-over that do not check out; those clients are placed anew")
	}
	entries := in.Affinity()
	if len(entries) == 0 {
		return
	}
	now := clk.Now()
	table := map[service.ServicePortName][]loadbalancer.AffinityEntry{}
	for _, e := range entries {
		table[e.Service] = append(table[e.Service], loadbalancer.AffinityEntry{Client: e.Client, Endpoint: e.Endpoint, LastUsed: now.Add(-e.Idle)})
	}
	px.InheritAffinity(table)
}
