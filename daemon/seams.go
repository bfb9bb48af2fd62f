package daemon

// seams.go: the daemon's side effects on the process, the node and the network, each behind a
// narrow seam, and their real implementations.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/sirupsen/logrus"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/memlimit"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/rlimit"
)

// deps are the daemon's side effects on the process, the node and the network, each behind a
// narrow seam so that tests run the real wiring without root.
type deps struct {
	host host
	// client builds the API client (cluster mode only).
	client func(o *Options, version string) (kubernetes.Interface, error)
	// portals builds what --portal-mode needs: rules or addresses, conntrack, listen plan.
	// Ports the running proxy handed over (inh, nil without) are held on its sockets.
	portals func(ctx context.Context, o *Options, hostIPs map[portal.Family]netip.Addr, events *serviceEvents, inh *handover.Inherited, log logrus.FieldLogger) (portalMode, error)
	// listen opens the listener of an HTTP server (--healthz-bind-address, --metrics-bind-address).
	listen func(addr string) (net.Listener, error)
	// notifyReload relays the reload signal (SIGHUP) to c until stop is called.
	notifyReload func(c chan<- os.Signal) (stop func())
	// kernelPorts reads the node's ephemeral port range, where proxy ports come from without
	// --proxy-port-range.
	kernelPorts func() (proxier.KernelPorts, error)
	// probeIOUring says whether the io_uring TCP engine can run here (--io-engine=auto); nil
	// means tcp.ProbeIOUring.
	probeIOUring func() error
	// sourceNode builds the transparent source mode's node plumbing; nil means none (the mode
	// resolves to proxy).
	sourceNode func(o *Options, log logrus.FieldLogger) sourceNode
	clock      clock.Clock
}

// systemDeps are the real process, node, API server and network.
func systemDeps() deps {
	return deps{
		host:    systemHost{},
		client:  newClient,
		portals: newPortalMode,
		listen:  func(addr string) (net.Listener, error) { return net.Listen("tcp", addr) },
		notifyReload: func(c chan<- os.Signal) func() {
			signal.Notify(c, syscall.SIGHUP)
			return func() { signal.Stop(c) }
		},
		kernelPorts: readKernelPorts,
		sourceNode:  newSourceNode,
		clock:       clock.RealClock{},
	}
}

// The GC targets (GOGC) of the start, until the first sync, and of the steady state after it.
const (
	startGCPercent  = 100
	steadyGCPercent = 50
)

// wantNoFile is the descriptor limit we ask for: two per proxied TCP connection.
const wantNoFile = 1 << 20

// host is what the daemon changes on the process and the node before it serves, and what it
// checks there: root-only side effects, so tests of the wiring fake them.
type host interface {
	// tune sets the GC target, the OOM score, the conntrack sysctls and the open-file limit.
	// Failures are logged, never fatal: an unprivileged container still proxies. settle is called
	// once the first sync has programmed everything (the start's GC target gives way to the
	// steady state's).
	tune(o *Options, log logrus.FieldLogger) (settle func())
	// check fails, with the fix, when a tool or a privilege the portals need is missing.
	check(o *Options) error
}

// systemHost is the real process and node.
type systemHost struct{}

var _ host = systemHost{}

func (systemHost) tune(o *Options, log logrus.FieldLogger) (settle func()) {
	settle = func() {}
	if os.Getenv("GOGC") == "" {
		// A node agent's live heap is small and its allocation rate low, so a tighter GC target
		// costs little CPU and keeps RSS near the live heap: at 10,000 service ports the default
		// (heap may double before a collection) left ~90 MB of garbage resident. GOGC overrides.
		//
		// Until the first sync, though, the process decodes every object (over 400 MB allocated
		// for 10,000 services from a file) while its live heap grows from nothing: at 50 the
		// collector ran so often that the proxy's CPU to its first sync was 3.9 s instead of 2.1 s.
		// The start runs at the default target (200 saved no more CPU and raised the peak RSS
		// by 11 MiB); the first sync then lowers it and hands the garbage back.
		debug.SetGCPercent(startGCPercent)
		settle = func() { debug.SetGCPercent(steadyGCPercent) }
	}
	applyMemoryLimit(log)
	applyOOMScoreAdj(o, log)
	applyConntrackSysctls(o, log)
	if res, err := rlimit.RaiseNoFile(wantNoFile); err != nil {
		log.WithError(err).Warn("Cannot raise the open-file limit")
	} else if res.Short() {
		log.WithField("limit", res.After.Cur).Warn("Open-file limit is below what a busy proxy may need; raise the hard limit (LimitNOFILE)")
	}
	return settle
}

// applyMemoryLimit gives the Go runtime a soft memory limit of nine tenths of the process's
// cgroup memory limit, when it has one and GOMEMLIMIT does not say otherwise: the runtime does not
// read the cgroup itself, and without it the collector lets the heap grow to twice its live size
// and the kernel OOM-kills the proxy at a peak a few more collections would have kept below the
// limit.
func applyMemoryLimit(log logrus.FieldLogger) {
	if os.Getenv("GOMEMLIMIT") != "" {
		return
	}
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		log.WithError(err).Debug("No cgroup to read a memory limit from")
		return
	}
	l, err := memlimit.FromCgroup(self, "/sys/fs/cgroup")
	if err != nil {
		log.WithError(err).Warn("Cannot read the cgroup's memory limit; the Go runtime has no soft limit (set GOMEMLIMIT)")
		return
	}
	if l.Bytes == 0 {
		return
	}
	soft := memlimit.Soft(l.Bytes)
	debug.SetMemoryLimit(soft)
	log.WithFields(logrus.Fields{"cgroupLimit": l.Bytes, "file": l.File, "softLimit": soft}).Info("Go soft memory limit set below the cgroup's memory limit (GOMEMLIMIT overrides)")
}

func (systemHost) check(o *Options) error { return checkTools(o) }

// checkTools fails fast, with the fix, when a tool the portals exec is missing.
func checkTools(o *Options) error {
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
