package daemon

import (
	"fmt"
	"io"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/spf13/pflag"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// Options are the command-line flags. Names follow kube-proxy wherever it has the same setting,
// so a kube-proxy command line carries over. ParseOptions fills and validates them.
type Options struct {
	kubeconfig         string
	master             string
	hostnameOverride   string
	bindAddress        string
	proxyPortRange     string
	udpTimeout         time.Duration
	udpMaxSessions     int
	udpLoops           int
	syncPeriod         time.Duration
	minSyncPeriod      time.Duration
	configSyncPeriod   time.Duration
	healthzBindAddress string
	metricsBindAddress string
	nodePortAddresses  []string
	clusterCIDR        string
	cleanup            bool
	servicesFile       string
	fileCheckPeriod    time.Duration
	logLevel           string
	logFormat          string
	version            bool
	apiQPS             float32
	apiBurst           int
	protectProxyPorts  bool
	drainEndpoints     bool
	tcpIdleTimeout     time.Duration
	ioEngine           string
	iptablesVariant    string
	shutdownTimeout    time.Duration
	accessLog          bool
	portalMode         string
	defaultDataPath    string
	portalInterface    string
	handoverSocket     string
	readyFile          string
	bindStateFile      string
	restartSnapshot    string
	sourceMode         string
	nodePodCIDR        string

	// What the metrics side shows beyond loopback: metricsOnlyBindAddress serves /metrics
	// alone, for a scraper off the node; profiling adds pprof to metricsBindAddress.
	metricsOnlyBindAddress string
	profiling              bool

	// The live flow stream (observe): the ring, observers, capture, and the address that serves
	// it beyond loopback with token authentication.
	flows flowOptions

	// kube-proxy settings for the node, applied at start (config.go, sysctl.go).
	configFile                string
	writeConfigTo             string
	oomScoreAdj               int32
	conntrackMaxPerCore       int32
	conntrackMin              int32
	conntrackTCPEstablished   time.Duration
	conntrackTCPCloseWait     time.Duration
	conntrackTCPBeLiberal     bool
	conntrackUDPTimeout       time.Duration
	conntrackUDPStreamTimeout time.Duration

	// From --config: which flags it set (flag name -> field, for errors) and what the startup log
	// reports (logConfigNotes).
	configFields   map[string]string
	configIgnored  []string
	configWarnings []string

	// Parsed forms, filled by validate.
	bind      netip.Addr
	portRange proxier.PortRange
	nodePorts []netip.Prefix
	// podCIDRs is --cluster-cidr parsed: sources that are pods, whose traffic to an external
	// portal is cluster traffic.
	podCIDRs []netip.Prefix
	// nodePodCIDRs is --node-pod-cidr parsed: this node's own pods (the transparent source
	// mode); empty: the Node object's spec.podCIDRs.
	nodePodCIDRs []netip.Prefix

	// flags is the command line they came from: --write-config-to and the startup line need
	// to know which flags were given.
	flags *pflag.FlagSet
}

// flowOptions configure the live flow stream (package observe).
type flowOptions struct {
	ringSize, maxObservers, maxRate, captureBytes int
	capture                                       bool
	bindAddress                                   string
}

// Defaults and bounds of the flow stream's options.
const (
	defaultFlowRingSize     = 8192
	maxFlowRingSize         = 1 << 22 // ~1.4 GB of events: beyond any use
	defaultFlowMaxObservers = 16
	defaultFlowMaxRate      = 10000
	defaultFlowCaptureBytes = 64 << 10
	maxFlowCaptureBytes     = 16 << 20
)

// defaultFlowOptions are the flow options of an empty command line.
func defaultFlowOptions() flowOptions {
	return flowOptions{ringSize: defaultFlowRingSize, maxObservers: defaultFlowMaxObservers, maxRate: defaultFlowMaxRate,
		captureBytes: defaultFlowCaptureBytes}
}

// Action is what a command line asks for.
type Action int

// The actions, in the order they are checked.
const (
	ActionServe       Action = iota // run the proxy until stopped
	ActionVersion                   // --version
	ActionWriteConfig               // --write-config-to
	ActionCleanup                   // --cleanup
)

// Action says what the command line asks for.
func (o *Options) Action() Action {
	switch {
	case o.version:
		return ActionVersion
	case o.writeConfigTo != "":
		return ActionWriteConfig
	case o.cleanup:
		return ActionCleanup
	}
	return ActionServe
}

// ParseOptions parses and validates a command line (without the program name). The --config
// file applies first, then the flags given explicitly, then validation. Errors name the flag or
// the file's field; --help gives pflag.ErrHelp after printing the usage.
func ParseOptions(args []string) (*Options, error) {
	o, _, err := parseOptions(args)
	return o, err
}

func newFlagSet(o *Options) *pflag.FlagSet {
	fs := pflag.NewFlagSet("kube-portal-proxy", pflag.ContinueOnError)
	fs.SortFlags = false
	fs.StringVar(&o.configFile, "config", "", "Path to a KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1); flags given explicitly override its values.")
	fs.StringVar(&o.writeConfigTo, "write-config-to", "", "Write the effective configuration to this file as a KubeProxyConfiguration, then exit.")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "Path to a kubeconfig file; empty means in-cluster configuration (or --services-file).")
	fs.StringVar(&o.master, "master", "", "Address of the Kubernetes API server (overrides the kubeconfig).")
	fs.StringVar(&o.hostnameOverride, "hostname-override", "", "Name of this node, used to read its addresses from the Node object.")
	fs.StringVar(&o.bindAddress, "bind-address", "0.0.0.0", "Address the proxy sockets listen on. 0.0.0.0 or :: means all: pod traffic is REDIRECTed and host traffic DNATed to the node IP; a specific address is the DNAT target for both.")
	fs.StringVar(&o.proxyPortRange, "proxy-port-range", "", "Local ports for proxy sockets: begin-end, begin+offset or a single port; empty means kernel-chosen.")
	fs.DurationVar(&o.udpTimeout, "udp-timeout", udp.DefaultIdleTimeout, "How long an idle UDP session is kept. Long enough for a resolver retrying a 2-5 s upstream timeout (the legacy 250ms was not).")
	fs.IntVar(&o.udpMaxSessions, "udp-max-sessions", udp.DefaultMaxSessions, "Maximum UDP sessions per service port; the least recently used is evicted beyond it.")
	fs.IntVar(&o.udpLoops, "udp-loops", 0, "Loops per UDP service port, each on its own SO_REUSEPORT socket with its own sessions (1-16); 0 means two in bind mode with more than one CPU, else one.")
	fs.DurationVar(&o.syncPeriod, "iptables-sync-period", 30*time.Second, "Maximum interval between syncs of sockets and portal rules (the periodic repair).")
	fs.DurationVar(&o.minSyncPeriod, "iptables-min-sync-period", time.Second, "Minimum interval between syncs; changes within it are batched.")
	fs.DurationVar(&o.configSyncPeriod, "config-sync-period", 15*time.Minute, "Resync period of the Service and EndpointSlice informers.")
	fs.StringVar(&o.healthzBindAddress, "healthz-bind-address", "0.0.0.0:10256", "ip:port of /healthz and /livez; empty disables.")
	fs.StringVar(&o.metricsBindAddress, "metrics-bind-address", "127.0.0.1:10249", "ip:port of /metrics and the debug pages (client addresses, live connections, the rules; pprof with --profiling); empty disables. Keep it on loopback: for a scraper off the node, use --metrics-only-bind-address.")
	fs.StringVar(&o.metricsOnlyBindAddress, "metrics-only-bind-address", "", "ip:port that serves /metrics and nothing else, within the health address's limits: the address to open to Prometheus (e.g. 0.0.0.0:10251) while --metrics-bind-address stays on loopback. Empty disables.")
	fs.BoolVar(&o.profiling, "profiling", false, "Serve Go's profiler (pprof) under /debug/pprof/ on --metrics-bind-address (kube-proxy's --profiling, the file's enableProfiling).")
	fs.IntVar(&o.flows.ringSize, "flow-ring-size", defaultFlowRingSize, "Flow events kept for `observe --last` and /debug/flows, in fixed memory (~350 bytes each: 2.8 MB at the default); 0 turns the flow stream off.")
	fs.IntVar(&o.flows.maxObservers, "flow-max-observers", defaultFlowMaxObservers, "Most observers of /debug/flows at once; more are answered 429.")
	fs.IntVar(&o.flows.maxRate, "flow-max-rate", defaultFlowMaxRate, "Most flow events per second one observer is sent (its rate= asks for less); the rest are dropped and counted in its stream. 0 means no cap.")
	fs.BoolVar(&o.flows.capture, "flow-capture", false, "Let observers capture payload (observe --pcap): the first --flow-capture-bytes of each matching flow, both ways. Off by default: a capture carries the traffic's bytes.")
	fs.IntVar(&o.flows.captureBytes, "flow-capture-bytes", defaultFlowCaptureBytes, "Most payload bytes captured per flow (each observer may ask for less).")
	fs.StringVar(&o.flows.bindAddress, "flows-bind-address", "", "ip:port that serves /debug/flows beyond loopback, for `observe --node`: every request needs a bearer token that the API server authenticates (TokenReview) and authorizes (SubjectAccessReview: get nodes/flows, nodes/capture for a capture). Needs an API server. Empty disables.")
	fs.StringSliceVar(&o.nodePortAddresses, "nodeport-addresses", nil, "CIDRs of the node addresses that accept NodePort traffic; empty means all.")
	fs.StringVar(&o.clusterCIDR, "cluster-cidr", "", "The pods' CIDR range(s), comma-separated (one per family): traffic from them to a node port, external or load-balancer IP of an externalTrafficPolicy: Local service is cluster traffic, as in kube-proxy. Empty: such pod traffic is external traffic.")
	fs.StringVar(&o.sourceMode, "source-mode", string(service.SourceAuto), "The address endpoints see a proxied connection or UDP session come from: transparent (the client's address and port: the proxy binds its socket to it, and policy routing brings the replies back; see docs/transparent.md), proxy (the node's, as kube-proxy's userspace mode did), or auto: transparent where the node supports it, else proxy, saying why in the log (transparent: as an error). A Service can choose with the portal-proxy.kubernetes.io/source-mode annotation.")
	fs.StringVar(&o.nodePodCIDR, "node-pod-cidr", "", "This node's pod CIDR(s), comma-separated (one per family), for the transparent source mode: a client in them is a pod of this node, whose replies come back through it. Empty: the Node object's spec.podCIDRs.")
	fs.BoolVar(&o.cleanup, "cleanup", false, "Remove every rule and chain this proxy installs (IPv4 and IPv6), then exit.")
	fs.StringVar(&o.servicesFile, "services-file", "", "Standalone mode: read Service and EndpointSlice manifests from this YAML file or directory instead of an API server.")
	fs.DurationVar(&o.fileCheckPeriod, "services-file-check-period", time.Second, "How often --services-file is checked for changes (SIGHUP reloads at once).")
	fs.StringVar(&o.logLevel, "log-level", "info", "Log level: debug, info, warn, error.")
	fs.StringVar(&o.logFormat, "log-format", "text", "Log format: text or json.")
	fs.BoolVar(&o.version, "version", false, "Print the version and exit.")
	fs.Float32Var(&o.apiQPS, "kube-api-qps", 5, "QPS to use while talking with the API server.")
	fs.IntVar(&o.apiBurst, "kube-api-burst", 10, "Burst to use while talking with the API server.")
	fs.BoolVar(&o.protectProxyPorts, "protect-proxy-ports", true, "Drop new connections that reach a proxy port directly instead of through a portal (the KUBE-PORTALS-GUARD chain).")
	fs.BoolVar(&o.drainEndpoints, "drain-removed-endpoints", false, "Close established TCP connections to endpoints that were removed (UDP sessions always move).")
	fs.DurationVar(&o.tcpIdleTimeout, "tcp-idle-timeout", 0, "Close TCP connections idle in both directions for this long; 0 never does.")
	fs.StringVar(&o.ioEngine, "io-engine", tcp.EngineAuto, "How TCP connections are accepted and their bytes moved: io_uring (one ring per CPU, no goroutine per connection), epoll (the Go runtime poller), or auto: io_uring when the kernel and the sandbox allow it (probed at start), else epoll, saying why in the log.")
	fs.StringVar(&o.iptablesVariant, "iptables-variant", "", "Which iptables binaries to run: empty for the system's, nft or legacy.")
	fs.StringVar(&o.portalMode, "portal-mode", "iptables", "How service traffic reaches the proxy: iptables (the legacy KUBE-PORTALS NAT rules) or bind (service IPs on a local interface, sockets listen on them; no NAT needed).")
	fs.StringVar(&o.defaultDataPath, "default-data-path", "proxy", "Data path of a Service without the portal-proxy.kubernetes.io/data-path annotation: proxy (portal rules to a proxy socket: access log, per-endpoint flows, balancing policies) or kernel (kube-proxy's iptables chains DNAT straight to the endpoints, nothing in user space). Kernel needs --portal-mode=iptables.")
	fs.StringVar(&o.portalInterface, "portal-interface", bind.DefaultInterface, "Interface that carries the service IPs in --portal-mode=bind.")
	fs.BoolVar(&o.accessLog, "access-log", false, "Log one line per TCP connection and UDP session when it ends, for every service (per Service: annotation portal-proxy.kubernetes.io/access-log: \"true\").")
	fs.StringVar(&o.handoverSocket, "handover-socket", "", "Unix socket (a host path) on which a running proxy hands its listening sockets to a new one started with the same flag, so a planned restart or upgrade refuses no connection: the new process takes the sockets, the old one stops accepting once the new one has synced, finishes its connections and exits at SIGTERM. Empty disables.")
	fs.StringVar(&o.readyFile, "ready-file", "", "File created once this process serves (its first sync done and, after a hand-over, its predecessor told), removed at exit. In a container's own filesystem it tells the new pod of an update from the old one, whose HTTP probes reach either process on the shared health port (the DaemonSet's startupProbe tests for it). Empty disables.")
	fs.StringVar(&o.bindStateFile, "bind-state-file", "", "In --portal-mode=bind, a file (a host path) where the proxy keeps which addresses and ports it listens on, so a process restarted after a crash or SIGKILL reopens them before it has read the Services. Keep it out of the --services-file directory. Empty disables.")
	fs.StringVar(&o.restartSnapshot, "restart-snapshot-file", "", "A file (a host path) where the proxy keeps a snapshot of what it serves (each service port's endpoints and balancing settings), written at most once a second after a change, so a process restarted after a crash or SIGKILL serves the connections of the proxy ports it reopens from it until it has read the Services, instead of holding them until then. Keep it out of the --services-file directory. Empty disables.")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 10*time.Second, "How long SIGTERM waits for sockets to close before exiting.")
	fs.Int32Var(&o.oomScoreAdj, "oom-score-adj", -999, "The oom_score_adj of this process, in [-1000, 1000] (lowering it needs CAP_SYS_RESOURCE).")
	fs.Int32Var(&o.conntrackMaxPerCore, "conntrack-max-per-core", 32*1024, "Set nf_conntrack_max to this many entries per CPU (at least --conntrack-min); 0 leaves it as it is.")
	fs.Int32Var(&o.conntrackMin, "conntrack-min", 128*1024, "Minimum nf_conntrack_max, whatever --conntrack-max-per-core gives.")
	fs.DurationVar(&o.conntrackTCPEstablished, "conntrack-tcp-timeout-established", 24*time.Hour, "Set nf_conntrack_tcp_timeout_established; 0 leaves it as it is.")
	fs.DurationVar(&o.conntrackTCPCloseWait, "conntrack-tcp-timeout-close-wait", time.Hour, "Set nf_conntrack_tcp_timeout_close_wait; 0 leaves it as it is.")
	fs.BoolVar(&o.conntrackTCPBeLiberal, "conntrack-tcp-be-liberal", false, "Set nf_conntrack_tcp_be_liberal, so out-of-window TCP packets are not marked INVALID.")
	fs.DurationVar(&o.conntrackUDPTimeout, "conntrack-udp-timeout", 0, "Set nf_conntrack_udp_timeout (unreplied UDP entries); 0 leaves it as it is.")
	fs.DurationVar(&o.conntrackUDPStreamTimeout, "conntrack-udp-timeout-stream", 0, "Set nf_conntrack_udp_timeout_stream (assured UDP entries); 0 leaves it as it is.")
	return fs
}

// parseOptions is ParseOptions, also returning the flag set.
func parseOptions(args []string) (*Options, *pflag.FlagSet, error) {
	o := &Options{}
	fs := newFlagSet(o)
	o.flags = fs
	if err := fs.Parse(args); err != nil {
		return nil, fs, err
	}
	if fs.NArg() > 0 {
		return nil, fs, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.configFile != "" {
		if err := o.loadConfigFile(fs); err != nil {
			return nil, fs, err
		}
	}
	return o, fs, o.validate()
}

// validate checks the options and parses the addresses and ranges they name, failing at the first
// that is wrong with the setting's name (a flag, or the configuration file's field).
func (o *Options) validate() error {
	if err := o.parseNetworks(); err != nil {
		return err
	}
	for _, c := range o.checks() {
		if !c.ok {
			return fmt.Errorf("%s: %s", o.setting(c.flag), c.msg)
		}
	}
	if err := o.checkListenAddresses(); err != nil {
		return err
	}
	if _, err := parseLevel(o.logLevel); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	return nil
}

// parseNetworks parses --bind-address, --proxy-port-range, --nodeport-addresses and
// --cluster-cidr.
func (o *Options) parseNetworks() error {
	var err error
	if o.bind, err = netip.ParseAddr(o.bindAddress); err != nil {
		return fmt.Errorf("%s %q: %w", o.setting("--bind-address"), o.bindAddress, err)
	}
	o.bind = o.bind.Unmap()
	if o.bind.IsLoopback() {
		return fmt.Errorf("%s %s: cannot proxy on localhost (portal rules cannot DNAT to a loopback address)", o.setting("--bind-address"), o.bind)
	}
	if o.portRange, err = proxier.ParsePortRange(o.proxyPortRange); err != nil {
		return fmt.Errorf("%s: %w", o.setting("--proxy-port-range"), err)
	}
	for _, c := range o.nodePortAddresses {
		if strings.TrimSpace(c) == nodePortPrimary {
			return fmt.Errorf("%s %q: %w", o.setting("--nodeport-addresses"), c, errNodePortPrimary)
		}
		p, err := netip.ParsePrefix(strings.TrimSpace(c))
		if err != nil {
			return fmt.Errorf("%s %q: %w", o.setting("--nodeport-addresses"), c, err)
		}
		o.nodePorts = append(o.nodePorts, p.Masked())
	}
	for _, c := range strings.Split(o.clusterCIDR, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		p, err := netip.ParsePrefix(c)
		if err != nil {
			return fmt.Errorf("%s %q: %w", o.setting("--cluster-cidr"), c, err)
		}
		o.podCIDRs = append(o.podCIDRs, p.Masked())
	}
	for _, c := range strings.Split(o.nodePodCIDR, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		p, err := netip.ParsePrefix(c)
		if err != nil {
			return fmt.Errorf("%s %q: %w", o.setting("--node-pod-cidr"), c, err)
		}
		o.nodePodCIDRs = append(o.nodePodCIDRs, p.Masked())
	}
	return nil
}

// optionCheck is one condition a setting must meet, and what it says when it does not.
type optionCheck struct {
	ok   bool
	flag string
	msg  string
}

// checks are the conditions on single settings and on pairs of them, in the order validate
// reports them.
func (o *Options) checks() []optionCheck {
	return []optionCheck{
		{o.udpTimeout > 0, "--udp-timeout", "must be > 0"},
		{o.udpMaxSessions > 0, "--udp-max-sessions", "must be > 0"},
		{o.udpLoops >= 0 && o.udpLoops <= 16, "--udp-loops", "must be 0-16"},
		{o.syncPeriod > 0, "--iptables-sync-period", "must be > 0"},
		{o.minSyncPeriod >= 0, "--iptables-min-sync-period", "must be >= 0"},
		{o.minSyncPeriod <= o.syncPeriod, "--iptables-min-sync-period", "must not exceed --iptables-sync-period"},
		{o.configSyncPeriod >= 0, "--config-sync-period", "must be >= 0"},
		{o.fileCheckPeriod > 0, "--services-file-check-period", "must be > 0"},
		{o.apiQPS > 0, "--kube-api-qps", "must be > 0"},
		{o.apiBurst > 0, "--kube-api-burst", "must be > 0"},
		{o.tcpIdleTimeout >= 0, "--tcp-idle-timeout", "must be >= 0"},
		{slices.Contains(tcp.EngineNames, o.ioEngine), "--io-engine", "must be auto, io_uring or epoll"},
		{o.shutdownTimeout > 0, "--shutdown-timeout", "must be > 0"},
		{o.logFormat == "text" || o.logFormat == "json", "--log-format", "must be text or json"},
		{o.portalMode == "iptables" || o.portalMode == "bind", "--portal-mode", "must be iptables or bind"},
		{o.defaultDataPath == "proxy" || o.defaultDataPath == "kernel", "--default-data-path", "must be proxy or kernel"},
		{o.defaultDataPath != "kernel" || o.portalMode == "iptables", "--default-data-path", "kernel needs --portal-mode=iptables (bind mode has no NAT)"},
		{slices.Contains([]string{string(service.SourceAuto), string(service.SourceProxy), string(service.SourceTransparent)}, o.sourceMode), "--source-mode", "must be auto, proxy or transparent"},
		{o.portalInterface != "" && len(o.portalInterface) < 16, "--portal-interface", "must be a valid interface name (1-15 characters)"},
		{o.oomScoreAdj >= -1000 && o.oomScoreAdj <= 1000, "--oom-score-adj", "must be within [-1000, 1000]"},
		{o.conntrackMaxPerCore >= 0, "--conntrack-max-per-core", "must be >= 0"},
		{o.conntrackMin >= 0, "--conntrack-min", "must be >= 0"},
		{o.conntrackTCPEstablished >= 0, "--conntrack-tcp-timeout-established", "must be >= 0"},
		{o.conntrackTCPCloseWait >= 0, "--conntrack-tcp-timeout-close-wait", "must be >= 0"},
		{o.conntrackUDPTimeout >= 0, "--conntrack-udp-timeout", "must be >= 0"},
		{o.conntrackUDPStreamTimeout >= 0, "--conntrack-udp-timeout-stream", "must be >= 0"},
		{o.flows.ringSize >= 0 && o.flows.ringSize <= maxFlowRingSize, "--flow-ring-size", fmt.Sprintf("must be 0-%d", maxFlowRingSize)},
		{o.flows.maxObservers > 0, "--flow-max-observers", "must be > 0"},
		{o.flows.maxRate >= 0, "--flow-max-rate", "must be >= 0"},
		{o.flows.captureBytes > 0 && o.flows.captureBytes <= maxFlowCaptureBytes, "--flow-capture-bytes", fmt.Sprintf("must be 1-%d", maxFlowCaptureBytes)},
		{o.flows.bindAddress == "" || o.servicesFile == "", "--flows-bind-address", "needs an API server to check tokens (not --services-file)"},
		{o.flows.bindAddress == "" || o.flows.ringSize > 0, "--flows-bind-address", "needs the flow stream (--flow-ring-size > 0)"},
		{o.iptablesVariant == "" || o.iptablesVariant == "nft" || o.iptablesVariant == "legacy", "--iptables-variant", "must be empty, nft or legacy"},
	}
}

// checkListenAddresses checks that each HTTP server's address, when set, is an ip:port.
func (o *Options) checkListenAddresses() error {
	for _, hp := range []struct{ flag, v string }{{"--healthz-bind-address", o.healthzBindAddress}, {"--metrics-bind-address", o.metricsBindAddress},
		{"--metrics-only-bind-address", o.metricsOnlyBindAddress}, {"--flows-bind-address", o.flows.bindAddress}} {
		if hp.v == "" {
			continue
		}
		if _, err := netip.ParseAddrPort(hp.v); err != nil {
			return fmt.Errorf("%s %q: want ip:port: %w", o.setting(hp.flag), hp.v, err)
		}
	}
	return nil
}

// NewLogger is the logger --log-level and --log-format ask for, writing to out.
func NewLogger(o *Options, out io.Writer) *logrus.Logger {
	log := logrus.New()
	log.SetOutput(out)
	level, _ := parseLevel(o.logLevel)
	log.SetLevel(level)
	if o.logFormat == "json" {
		log.SetFormatter(&logrus.JSONFormatter{})
	} else {
		log.SetFormatter(&logrus.TextFormatter{FullTimestamp: true})
	}
	return log
}

func parseLevel(s string) (logrus.Level, error) {
	switch strings.ToLower(s) {
	case "debug", "info", "warn", "warning", "error":
		return logrus.ParseLevel(s)
	}
	return 0, fmt.Errorf("%q: want debug, info, warn or error", s)
}

// changedFlags lists the flags given on the command line, for the startup line.
func changedFlags(fs *pflag.FlagSet) string {
	var parts []string
	fs.Visit(func(f *pflag.Flag) { parts = append(parts, "--"+f.Name+"="+f.Value.String()) })
	return strings.Join(parts, " ")
}

// nodeName is --hostname-override, or the host name.
func nodeName(o *Options) string {
	if o.hostnameOverride != "" {
		return o.hostnameOverride
	}
	name, _ := os.Hostname()
	return name
}
