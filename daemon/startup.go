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
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
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

// startupNice is how much a successor of a hand-over lowers its CPU priority (its nice value)
// until it is ready. The predecessor serves every connection meanwhile, and on a small node the
// successor's start (decoding the initial lists, 10,000 sockets, iptables-restore) took both CPUs
// while the predecessor answered. At +5 the successor's weight is a third of a normal task's: the
// predecessor's data path wins when it wakes, and the start still ends in seconds beside a node
// whose CPUs are all busy (at +10, a tenth, it took 22 s there at 10,000 ports, past the
// predecessor's SIGTERM and its wait for the ready).
const startupNice = 5

// lowerPriority lowers every thread of this process (and so the threads and commands they start,
// which inherit it) by startupNice, and returns what restores the nice value it had. Linux keeps
// the nice value per thread, so each thread in /proc/self/task is set. Going back up needs
// RLIMIT_NICE to allow the old value (CAP_SYS_NICE is not in the DaemonSet's capabilities, but
// CAP_SYS_RESOURCE is): the limit is raised first, only as far as the nice value the process
// started with, and if that fails nothing is lowered: a process that could not come back would
// serve at low priority for its whole life.
func lowerPriority(log logrus.FieldLogger) (restore func()) {
	orig, err := niceOf(0)
	if err != nil {
		log.WithError(err).Warn("Cannot read this process's nice value; starting at normal priority beside the running proxy")
		return func() {}
	}
	if err := allowNice(orig); err != nil && !hasCapSysNice() {
		log.WithError(err).Info("Cannot lower the start-up's CPU priority (raising RLIMIT_NICE to return needs CAP_SYS_RESOURCE); starting at normal priority beside the running proxy")
		return func() {}
	}
	low := min(orig+startupNice, 19)
	if _, err := setThreadsNice(low); err != nil {
		log.WithError(err).Warn("Cannot lower the start-up's CPU priority")
	} else {
		log.WithFields(logrus.Fields{"nice": low, "was": orig}).Info("Starting at a lower CPU priority beside the running proxy until ready")
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			// A thread created while the loop runs may have inherited the low value from one
			// not yet restored: go round until a pass finds nothing to change.
			for range 10 {
				changed, err := setThreadsNice(orig)
				if err != nil {
					log.WithError(err).Warn("Cannot restore the CPU priority after the start")
					return
				}
				if changed == 0 {
					return
				}
			}
		})
	}
}

// niceOf is a thread's nice value (tid 0: the calling thread). The raw getpriority system call
// returns 20 - nice.
func niceOf(tid int) (int, error) {
	p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		return 0, fmt.Errorf("getpriority %d: %w", tid, err)
	}
	return 20 - p, nil
}

// hasCapSysNice reports whether this process may set any nice value (CAP_SYS_NICE, bit 23 of
// its effective capabilities).
func hasCapSysNice() bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<unix.CAP_SYS_NICE) != 0
		}
	}
	return false
}

// allowNice raises RLIMIT_NICE, if needed, so that a thread may go back to nice value nice.
func allowNice(nice int) error {
	need := uint64(20 - nice)
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NICE, &lim); err != nil {
		return fmt.Errorf("getrlimit RLIMIT_NICE: %w", err)
	}
	if lim.Cur >= need {
		return nil
	}
	lim.Cur, lim.Max = need, max(lim.Max, need)
	if err := unix.Setrlimit(unix.RLIMIT_NICE, &lim); err != nil {
		return fmt.Errorf("setrlimit RLIMIT_NICE %d: %w", need, err)
	}
	return nil
}

// setThreadsNice sets the nice value of every thread of this process, reporting how many it
// changed. A thread that ended meanwhile is skipped.
func setThreadsNice(nice int) (changed int, err error) {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return 0, fmt.Errorf("list threads: %w", err)
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		cur, err := niceOf(tid)
		if errors.Is(err, unix.ESRCH) {
			continue
		}
		if err != nil {
			return changed, err
		}
		if cur == nice {
			continue
		}
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, nice); err != nil && !errors.Is(err, unix.ESRCH) {
			return changed, fmt.Errorf("setpriority thread %d to %d: %w", tid, nice, err)
		}
		changed++
	}
	return changed, nil
}

// sourcesAfterServing waits, in a process that reopens proxy sockets itself (no hand-over), until
// they serve before the sources start, and reports false if ctx ended first. Decoding the
// initial lists takes seconds of CPU at 10,000 Services; started beside the reopen, they took the
// CPUs it needed, and the last ports of a SIGKILL restart opened 1.4-3.5 s after the exec on a
// busy 2-CPU node. Nothing is lost by waiting: the reopened ports serve from the restart snapshot
// (or hold their connections) until the lists are in, and the first sync waits for the reopen
// anyway. A successor of a hand-over reopens only once its lists are in (its predecessor serves
// meanwhile), so it must not wait.
func sourcesAfterServing(ctx context.Context, handedOver bool, serving <-chan struct{}) bool {
	if handedOver {
		return true
	}
	select {
	case <-serving:
		return true
	case <-ctx.Done():
		return false
	}
}
