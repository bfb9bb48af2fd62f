package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/rlimit"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// wantNoFile is the descriptor limit we ask for: two per proxied TCP connection.
const wantNoFile = 1 << 20

// source is where Services and EndpointSlices come from.
type source interface {
	Run(ctx context.Context) error
}

// serve runs the daemon until ctx is done.
func serve(ctx context.Context, o *options, log *logrus.Logger) error {
	if os.Getenv("GOGC") == "" {
		// A node agent's live heap is small and its allocation rate low, so a tighter GC target
		// costs little CPU and keeps RSS near the live heap: at 10,000 service ports the default
		// (heap may double before a collection) left ~90 MB of garbage resident. GOGC overrides.
		debug.SetGCPercent(50)
	}
	applyOOMScoreAdj(o, log)
	applyConntrackSysctls(o, log)
	if res, err := rlimit.RaiseNoFile(wantNoFile); err != nil {
		log.WithError(err).Warn("Cannot raise the open-file limit")
	} else if res.Short() {
		log.WithField("limit", res.After.Cur).Warn("Open-file limit is below what a busy proxy may need; raise the hard limit (LimitNOFILE)")
	}
	if err := checkTools(o); err != nil {
		return err
	}

	var client kubernetes.Interface
	var nodeAddrs []netip.Addr
	if o.servicesFile == "" {
		c, err := newClient(o)
		if err != nil {
			return err
		}
		client = c
		nodeAddrs = nodeAddresses(ctx, c, o, log)
	}
	hostIPs := proxier.NodeIPs(proxier.HostNodeIPSources(o.bind, nodeAddrs))
	if len(hostIPs) == 0 && o.bind.IsUnspecified() {
		return errors.New("no node IP found (no global unicast address on any interface): set --bind-address")
	}
	log.WithField("nodeIPs", fmt.Sprint(hostIPs)).Info("Node IPs")

	clk := clock.RealClock{}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := proxier.NewMetrics()
	if err := metrics.Register(reg); err != nil {
		return fmt.Errorf("register metrics: %w", err)
	}
	health := proxier.NewHealth(clk, 2*o.syncPeriod)

	nodeName := o.hostnameOverride
	if nodeName == "" {
		nodeName, _ = os.Hostname()
	}
	events := newServiceEvents(ctx, client, nodeName, log)
	pm, err := newPortalMode(ctx, o, hostIPs, events, log)
	if err != nil {
		return err
	}
	defer pm.close()

	lb := loadbalancer.New(clk)
	px := proxier.New(proxier.Config{
		ListenIP: o.bind, PortRange: o.portRange, MinSyncPeriod: o.minSyncPeriod, SyncPeriod: o.syncPeriod,
		DrainTCP: o.drainEndpoints, ListenPlan: pm.plan, Clock: clk, Logger: log,
	}, proxier.Deps{
		Balancer: lb, Portals: pm.portals, Conntrack: pm.conntrack,
		Metrics: metrics, Health: health, Event: events.Warning,
		Sockets: proxier.RealSockets(proxier.AccessLog{All: o.accessLog, Log: log}.SocketConfigs(proxier.SocketConfig{
			TCP: tcp.Config{IdleTimeout: o.tcpIdleTimeout, Logger: log, FreeBind: pm.freeBind},
			UDP: udp.Config{IdleTimeout: o.udpTimeout, MaxSessions: o.udpMaxSessions, Logger: log, FreeBind: pm.freeBind},
		})),
	})
	reg.MustRegister(proxier.NewTrafficCollector(px))
	if pm.collector != nil {
		reg.MustRegister(pm.collector)
	}

	var src source
	if o.servicesFile != "" {
		fsrc := proxier.NewFileSource(o.servicesFile, px, clk, o.fileCheckPeriod, log)
		src = fsrc
		go reloadOnHUP(ctx, fsrc, log)
	} else {
		src = proxier.NewInformerSource(client, o.configSyncPeriod, px, log)
	}

	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "userspace") })
	mux.Handle("/healthz", health)
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	px.RegisterDebug(mux)
	mux.Handle("/debug/rules", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprint(w, pm.describe())
	}))
	healthMux := http.NewServeMux()
	healthMux.Handle("/healthz", health)
	healthMux.Handle("/livez", health)

	var servers []*http.Server
	for _, s := range []struct {
		addr string
		h    http.Handler
	}{{o.healthzBindAddress, healthMux}, {o.metricsBindAddress, mux}} {
		if s.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", s.addr)
		if err != nil {
			return fmt.Errorf("listen %s: %w", s.addr, err)
		}
		srv := &http.Server{Handler: s.h, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.WithError(err).WithField("address", s.addr).Error("HTTP server stopped")
			}
		}()
	}

	return runAll(ctx, o.shutdownTimeout, log, px.Run, func(ctx context.Context) {
		if err := src.Run(ctx); err != nil && ctx.Err() == nil {
			log.WithError(err).Error("Source stopped")
		}
	}, func(ctx context.Context) {
		<-ctx.Done()
		for _, s := range servers {
			sctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = s.Shutdown(sctx)
			cancel()
		}
	})
}

// runAll runs each function in its own goroutine until ctx is done, then waits for all of them,
// at most timeout.
func runAll(ctx context.Context, timeout time.Duration, log logrus.FieldLogger, fns ...func(context.Context)) error {
	var wg sync.WaitGroup
	for _, fn := range fns {
		wg.Go(func() { fn(ctx) })
	}
	<-ctx.Done()
	log.Info("Shutting down; portal rules stay in place so a restart does not black-hole services")
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-time.After(timeout):
		return fmt.Errorf("shutdown took longer than --shutdown-timeout=%v", timeout)
	}
}

func reloadOnHUP(ctx context.Context, f *proxier.FileSource, log logrus.FieldLogger) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
			log.Info("SIGHUP: reloading the services file")
			f.Reload()
		}
	}
}

// iptablesTool names a tool of the chosen variant the way Debian installs them:
// iptables-nft-restore, iptables-legacy-save, ...
func iptablesTool(o *options, tool string) string {
	if o.iptablesVariant == "" {
		return tool
	}
	return strings.Replace(tool, "iptables", "iptables-"+o.iptablesVariant, 1)
}

// checkTools fails fast, with the fix, when a tool the portals exec is missing.
func checkTools(o *options) error {
	for _, tool := range []string{"iptables", "iptables-restore", "iptables-save"} {
		if o.portalMode != "iptables" {
			break
		}
		if _, err := exec.LookPath(iptablesTool(o, tool)); err != nil {
			return fmt.Errorf("%s not found in PATH: install the iptables package (Debian/Ubuntu: apt-get install iptables), or run with --portal-mode=bind: %w", iptablesTool(o, tool), err)
		}
	}
	if os.Geteuid() != 0 {
		return errors.New("portal rules need root or CAP_NET_ADMIN: run as root (or with CAP_NET_ADMIN and CAP_NET_BIND_SERVICE)")
	}
	return nil
}

func newClient(o *options) (kubernetes.Interface, error) {
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
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	return c, nil
}

// nodeAddresses reads this node's InternalIP and ExternalIP addresses from its Node object. A
// missing Node is not fatal: the interfaces decide then.
func nodeAddresses(ctx context.Context, c kubernetes.Interface, o *options, log logrus.FieldLogger) []netip.Addr {
	name := o.hostnameOverride
	if name == "" {
		name, _ = os.Hostname()
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	node, err := c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		log.WithError(err).WithField("node", name).Warn("Cannot read the Node object; node IPs come from the interfaces")
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

// cleanup removes every chain and rule this proxy owns, for both families, and the bind mode's
// portal interface. Either may be absent: that is not an error.
func cleanup(ctx context.Context, o *options, log logrus.FieldLogger) error {
	var errs []error
	if _, err := exec.LookPath(iptablesTool(o, "iptables-restore")); err == nil {
		rules := portal.NewIPTables(portal.Config{Logger: log}, &portal.ExecRunner{Variant: o.iptablesVariant})
		errs = append(errs, rules.Cleanup(ctx))
	} else {
		log.Info("No iptables on this node: no portal rules to remove")
	}
	nl := &portal.Netlink{}
	defer nl.Close()
	errs = append(errs, portal.NewBind(portal.BindConfig{Interface: o.portalInterface, Logger: log}, nl).Cleanup(ctx))
	return errors.Join(errs...)
}

// portalCollector exports the iptables portal counters, with kube-proxy's name for restore failures.
func portalCollector(rules *portal.IPTables) prometheus.Collector {
	failures := prometheus.NewDesc("kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
		"Cumulative proxy iptables restore failures", nil, nil)
	restores := prometheus.NewDesc("kube_portal_proxy_iptables_restores_total", "iptables-restore runs.", nil, nil)
	repairs := prometheus.NewDesc("kube_portal_proxy_iptables_repairs_total", "Syncs that found the live chains changed by someone else and rewrote them.", nil, nil)
	count := prometheus.NewDesc("kube_portal_proxy_portal_rules", "Portal rules programmed (all families and tables).", nil, nil)
	return collectorFunc{descs: []*prometheus.Desc{failures, restores, repairs, count}, collect: func(ch chan<- prometheus.Metric) {
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
