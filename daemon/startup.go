package daemon

// startup.go: the order of a start, and its timing. A restarted process (SIGKILL, OOM kill,
// crash) serves again once it has reopened the proxy ports the rules in force point at (or, in
// bind mode, the sockets of its state file) with the restart snapshot's endpoints; nothing on that
// path may wait for the API server, which may be slow or unreachable when the node is under load.
// So the Node object (its addresses are the HOST DNAT target of the portal rules, its zone the
// topology hints) is read off that path, beside the reopen and before the sources start: the
// start takes the node IPs from the interfaces, and the Node's, once read, replace them before
// the first sync can program anything (nodeIPs). Each step is logged at debug level with its
// time since the start.

import (
	"maps"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

// startupSteps logs, at debug level, each step of the start with how long it took and how long
// after Run began it ended (`--log-level=debug`, message "Start-up step").
type startupSteps struct {
	clock       clock.PassiveClock
	start, last time.Time
	age         time.Duration // the process's age when Run began; -1: unknown
	log         logrus.FieldLogger
	mu          sync.Mutex // steps end on the Run goroutine and on the tasks'
}

func newStartupSteps(clk clock.PassiveClock, log logrus.FieldLogger) *startupSteps {
	now := clk.Now()
	age, err := procstat.Age(os.Getpid())
	if err != nil {
		age = -1
	} else {
		// exec, the runtime and the packages' init, flag parsing: before Run, and on a loaded
		// machine not always small.
		log.WithField("processAge", age.String()).Debug("Start-up: Run begins")
	}
	return &startupSteps{clock: clk, start: now, last: now, age: age, log: log}
}

// serving ends the start's critical path: the proxy sockets the rules in force (the bind state)
// point at are open. Logged at info level, with the time since the process started (10 ms
// resolution), so a restart's gap can be read from any log.
func (s *startupSteps) serving() {
	s.done("reopened the proxy sockets: serving")
	since := s.clock.Since(s.start)
	f := logrus.Fields{"sinceRun": since.Round(time.Millisecond).String()}
	if s.age >= 0 {
		f["sinceProcessStart"] = (s.age + since).Round(time.Millisecond).String()
	}
	s.log.WithFields(f).Info("Proxy sockets open: serving")
}

// done ends a step.
func (s *startupSteps) done(step string) {
	s.mu.Lock()
	now := s.clock.Now()
	took, since := now.Sub(s.last), now.Sub(s.start)
	s.last = now
	s.mu.Unlock()
	s.log.WithFields(logrus.Fields{"step": step, "took": took.Round(time.Microsecond).String(),
		"sinceStart": since.Round(time.Microsecond).String()}).Debug("Start-up step")
}

// nodeIPs keeps the portals' node IPs (the HOST DNAT target) in line with the Node object's
// addresses: the start programs nothing with the interfaces' guess, because the Node is read
// before the sources start and the first sync needs them; a Node whose addresses change later
// (the watch) gets its rules rewritten by the next sync.
type nodeIPs struct {
	bind    netip.Addr
	exclude []string // interfaces whose addresses are not node IPs (bind mode's portal link)
	// set hands the portals new node IPs; nil when the portal mode has no HOST rules (bind).
	set  func(map[portal.Family]netip.Addr)
	sync func() // asks for a sync
	log  logrus.FieldLogger

	mu    sync.Mutex // the first read and the Node watch
	addrs []netip.Addr
	cur   map[portal.Family]netip.Addr
}

// update applies a Node's addresses; a nil Node (not found, or the API unreachable) keeps the
// node IPs as they are.
func (n *nodeIPs) update(node *v1.Node) {
	if node == nil || n.set == nil {
		return
	}
	addrs := nodeAddresses(node)
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.addrs != nil && slices.Equal(addrs, n.addrs) {
		return
	}
	n.addrs = addrs
	ips := proxier.NodeIPs(proxier.HostNodeIPSources(n.bind, addrs, n.exclude...))
	if maps.Equal(ips, n.cur) {
		return
	}
	n.log.WithFields(logrus.Fields{"was": fmtIPs(n.cur), "nodeIPs": fmtIPs(ips)}).Info("Node IPs from the Node object differ: the portal rules follow at the next sync")
	n.cur = ips
	n.set(ips)
	n.sync()
}

func fmtIPs(ips map[portal.Family]netip.Addr) []string {
	var out []string
	for _, fam := range portal.Families {
		if ip, ok := ips[fam]; ok {
			out = append(out, ip.String())
		}
	}
	return out
}

// syncAfterFirst asks for a sync, unless the first has not run yet: it will use what changed, and
// an early request would only make it wait out the minimum sync period.
func syncAfterFirst(px interface {
	FirstSync() <-chan struct{}
	Sync()
}) func() {
	return func() {
		select {
		case <-px.FirstSync():
			px.Sync()
		default:
		}
	}
}
