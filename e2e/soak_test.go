package e2e

// The chaos soak (issue #30): real TCP and UDP clients through the cluster IPs and node ports of
// several Services, in both portal modes, while a fault injector, at random with a recorded seed,
// SIGKILLs and restarts the proxy, replaces it through the hand-over, churns the endpoints (scale
// up and down, pods turning terminating), restarts kube-apiserver and etcd, flushes the nat table
// of the node namespace (iptables mode) and takes the proxy's descriptors away for a moment.
// In iptables mode one more fault, `datapath`, moves the web Service between the proxy socket and
// the kernel path (its data-path annotation) while its clients run; it stays on the path written
// until the next such fault, so the other faults meet it on either path. Every failed request and
// every lost UDP answer is recorded with its time and cause; after each fault the invariants are
// checked (every target answers, rules and sockets as wanted, descriptors, goroutines and RSS
// bounded). The rule (soak_rule_test.go): only failures of attempts begun within soakKillWindow
// of a SIGKILL are excused; every other fault kind has a bound on its window's length and on the
// failures in flight during it (0 for most), a failure counts against every window it overlaps,
// and nothing may fail, nor any UDP answer be lost, between faults.
//
// Short by default (CI); `make soak` runs it for SOAK_DURATION (30m):
//
//	KPP_SOAK_DURATION=30m KPP_SOAK_SEED=42 go test ./e2e -run TestChaosSoak -v -timeout 80m
//
// KPP_SOAK_FAULTS=datapath,natflush limits the faults to those kinds.
//
// Address plan: the testbed's (client 10.244.x namespace, node IP testbed.NodeExtIP, cluster IPs
// in 10.96.0.0/16, three backend pods 10.244.1-3.10).

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

const (
	// soakTimeout bounds one client request: long enough for a SYN retransmitted after a nat flush
	// (1 s, then 3 s) to find the rules repaired by the next periodic sync.
	soakTimeout = 5 * time.Second
	// Bounds checked after every fault, against the figures of the same process before any
	// client ran: descriptors beyond those of its live connections (two each) and UDP sessions
	// (one each), goroutines beyond one per live connection (its dialer or a direction; parked
	// directions have none), and RSS.
	soakFDSlack        = 64
	soakGoroutineSlack = 100
	soakMaxRSS         = 256 << 20
)

// soakFaults are the fault kinds, with the modes they apply to.
var soakFaults = []struct {
	kind  string
	modes []string
}{
	{"sigkill", []string{"iptables", "bind"}},
	{"handover", []string{"iptables", "bind"}},
	{"churn", []string{"iptables", "bind"}},
	{"terminating", []string{"iptables", "bind"}},
	{"natflush", []string{"iptables"}},
	{"fdexhaust", []string{"iptables", "bind"}},
	{"apiserver", []string{"iptables", "bind"}},
	{"etcd", []string{"iptables", "bind"}},
	// The kernel path exists only where the proxy programs NAT: bind mode has none.
	{"datapath", []string{"iptables"}},
}

func TestChaosSoak(t *testing.T) {
	duration := 50 * time.Second
	if v := os.Getenv("KPP_SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("KPP_SOAK_DURATION=%q: %v", v, err)
		}
		duration = d
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("KPP_SOAK_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("KPP_SOAK_SEED=%q: %v", v, err)
		}
		seed = s
	}
	t.Logf("soak: %v per mode, seed %d (KPP_SOAK_SEED=%d repeats the fault sequence)", duration, seed, seed)
	// The modes run at once but take turns for faults: a restarted API server is a fault for
	// both, and must not fall into the other's SIGKILL window (a bind-mode process holds its
	// first connections until it has read the API).
	var turns sync.Mutex
	for _, m := range restartModes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			runSoak(t, m.name, m.flags, duration, seed, &turns)
		})
	}
}

// soakFailure is one failed request or stream exchange, or one lost UDP answer.
type soakFailure struct {
	target     string
	start, end time.Time
	err        error
	lost       bool // a UDP answer not received within a second (the client then asks again)
}

// soakWindow is when a fault was under way: from its start until the proxy served as wanted
// again. classifySoak charges failures to the windows they overlap.
type soakWindow struct {
	kind     string
	from, to time.Time
}

type soak struct {
	t     *testing.T
	n     *clusterNode
	mode  string
	flags []string
	rng   *rand.Rand

	proxy *proxyProcess
	procs []*proxyProcess // every process started, in order: logAround reads their logs
	base  procFigures     // the current process's figures after its first settle

	web, sticky *corev1.Service
	tcp         map[string]netip.AddrPort
	udp         netip.AddrPort
	webPath     string // the web Service's data path as last written (datapath faults; the injector's alone)

	mu       sync.Mutex
	failures []soakFailure
	inflight map[string]time.Time // each client's attempt under way: when it began
	attempts map[string]int
	slow     int // requests that took over a second (a retransmitted SYN)
	stickyTo map[string]int
	// ClientIP affinity: an answer from another pod than the client's last is a move. A move is
	// explained by a new process (sigkill: the affinity table lives in the process; handover: the
	// table goes over, but a client placed while both processes accept is not in it) or by an
	// endpoint change that took the client's pod out of use; any other is a switch.
	moves    map[string]int  // explained moves by cause
	switches int             // unexplained moves
	stickyIn map[string]bool // pods the sticky Service's ClientIP port should use (ready), as last written
	streams  int             // keep-alive stream connections completed cleanly

	udpFailed int         // UDP queries whose three tries were all lost (each loss is in failures)
	peak      procFigures // the highest figures seen at a settle
	faults    map[string]int
	windows   []soakWindow
	moved     time.Time // last endpoint change applied by the proxy, or new process: affinity may move then
	movedBy   string    // the fault kind behind moved
	active    string    // the fault under way, "" between faults
	// applied is, for each churn and terminating fault, how long the proxy took to use the
	// endpoints written (API write to /debug/services), with the fault kind before it.
	applied []propagation
}

// propagation is one endpoint change's delay from the API write until the proxy used it.
type propagation struct {
	after string // the fault before this one (an API server restart leaves the informers backing off)
	took  time.Duration
}

func runSoak(t *testing.T, mode string, flags []string, duration time.Duration, seed uint64, turns *sync.Mutex) {
	n := newClusterNode(t, 3)
	s := &soak{t: t, n: n, mode: mode, rng: rand.New(rand.NewPCG(seed, uint64(len(mode)))),
		attempts: map[string]int{}, inflight: map[string]time.Time{}, stickyTo: map[string]int{}, faults: map[string]int{}, moves: map[string]int{},
		stickyIn: map[string]bool{"pod1": true, "pod2": true, "pod3": true}}
	// As the DaemonSet runs it: the hand-over socket and the restart snapshot beside it.
	s.flags = append(slices.Clone(flags), "--handover-socket="+filepath.Join(n.dir, "run", "handover.sock"),
		"--restart-snapshot-file="+filepath.Join(n.dir, "run", "restart-snapshot"),
		"--shutdown-timeout=10s", "--iptables-sync-period=1s",
		// Debug: a connection the proxy resets says why ("no endpoints", "dial failed"), and an
		// unexplained failure is reported with each process's lines around it (logAround).
		"--log-level=debug")
	if mode == "bind" {
		s.flags = append(s.flags, "--bind-state-file="+filepath.Join(n.dir, "bind-state.json"))
	}
	s.web = n.createService(t, "web", webSpec(corev1.ServiceTypeNodePort))
	sticky := webSpec(corev1.ServiceTypeClusterIP)
	sticky.SessionAffinity = corev1.ServiceAffinityClientIP
	s.sticky = n.createService(t, "sticky", sticky)
	n.setPods(t, s.web, map[int]podState{1: podReady, 2: podReady, 3: podReady})
	n.setPods(t, s.sticky, map[int]podState{1: podReady, 2: podReady, 3: podReady})
	web, st := targetsOf(t, s.web), targetsOf(t, s.sticky)
	s.tcp = map[string]netip.AddrPort{"web cluster IP": web.clusterTCP, "web node port": web.nodePort, "sticky cluster IP": st.clusterTCP}
	s.udp = web.clusterUDP

	s.webPath = "proxy"

	s.proxy = n.startProxy(t, s.flags...)
	s.procs = append(s.procs, s.proxy)
	s.settle("the first proxy")

	stop := make(chan struct{})
	var clients sync.WaitGroup
	stopClients := sync.OnceFunc(func() { close(stop); clients.Wait() })
	defer stopClients() // also when a check fails the test
	for name, addr := range s.tcp {
		clients.Go(func() { s.shortTCP(stop, name, addr) })
	}
	clients.Go(func() { s.shortUDP(stop) })
	clients.Go(func() { s.stream(stop, web.clusterTCP) })

	kinds := s.kinds()
	end := time.Now().Add(duration)
	for i := 0; time.Now().Before(end) && !t.Failed(); i++ {
		pause := time.Duration(1000+s.rng.IntN(2000)) * time.Millisecond
		time.Sleep(pause) // traffic between faults: the clients run meanwhile
		kind := kinds[s.rng.IntN(len(kinds))]
		if i == 0 && slices.Contains(kinds, "datapath") {
			// Every run switches a Service's path at least once, and the faults after meet
			// it on the kernel path until a later datapath fault moves it back.
			kind = "datapath"
		}
		s.waitQuiet()
		func() {
			turns.Lock()
			defer turns.Unlock() // also when a check fails the test
			s.inject(kind)
			s.settle("after " + kind)
		}()
	}
	stopClients()
	s.report()
}

// kinds lists the fault kinds of the mode, only those KPP_SOAK_FAULTS names (comma-separated)
// when it is set: a focused run, such as 100 s of datapath switches alone.
func (s *soak) kinds() []string {
	var only []string
	if v := os.Getenv("KPP_SOAK_FAULTS"); v != "" {
		only = strings.Split(v, ",")
	}
	var out []string
	for _, f := range soakFaults {
		if slices.Contains(f.modes, s.mode) && (only == nil || slices.Contains(only, f.kind)) {
			out = append(out, f.kind)
		}
	}
	if len(out) == 0 {
		s.t.Fatalf("KPP_SOAK_FAULTS=%q names no fault kind of %s mode", os.Getenv("KPP_SOAK_FAULTS"), s.mode)
	}
	return out
}

// inject applies one fault and returns once it is over (not yet settled).
func (s *soak) inject(kind string) {
	t := s.t
	s.mu.Lock()
	s.faults[kind]++
	s.active = kind
	s.mu.Unlock()
	start := time.Now()
	switch kind {
	case "sigkill":
		s.proxy.Kill()
		reaped := time.Since(start) // the killed process's exit: its sockets are closed by then
		s.proxy = s.n.startProxy(t, s.flags...)
		s.procs = append(s.procs, s.proxy)
		for name, addr := range s.tcp {
			s.proxy.waitAnswers(t, s.n.bed.Client, addr, "after SIGKILL ("+name+")")
		}
		s.base = procFigures{}
		// Where a window's time goes: the kill until the killed process is reaped, the new
		// process's exec until its sockets serve (its own figure), the rest until every target
		// answered.
		serving := lineWith(s.proxy.LogTail(4000), "Proxy sockets open: serving")
		t.Logf("%s: sigkill: killed process reaped +%v, all targets answered +%v; new process: %s", s.mode,
			reaped.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), serving)
	case "handover":
		old := s.proxy
		next := s.n.startProxy(t, s.flags...)
		s.procs = append(s.procs, next)
		next.waitTookOver(t)
		if err := old.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		s.proxy, s.base = next, procFigures{}
		select {
		case <-old.Done():
		case <-time.After(proxyStopGrace):
			t.Errorf("the old proxy did not exit within %v of SIGTERM after the hand-over", proxyStopGrace)
		}
		t.Logf("%s: hand-over: the old process exited %v after the new one started", s.mode, time.Since(start).Round(time.Millisecond))
	case "churn", "terminating":
		written := map[*corev1.Service]map[int]podState{}
		for _, svc := range []*corev1.Service{s.web, s.sticky} {
			states := map[int]podState{}
			for i := 1; i <= 3; i++ {
				if s.rng.IntN(3) > 0 {
					states[i] = podReady
					if kind == "terminating" && s.rng.IntN(2) == 0 {
						states[i] = podTerminating
					}
				}
			}
			if len(states) == 0 || !slices.Contains(mapValues(states), podReady) {
				states[1+s.rng.IntN(3)] = podReady // never no ready endpoint: that refuses
			}
			if svc == s.sticky {
				// Before the write: from here on a move off a pod that stays ready is a switch.
				in := map[string]bool{}
				for i, st := range states {
					if st == podReady {
						in[fmt.Sprintf("pod%d", i)] = true
					}
				}
				s.mu.Lock()
				s.stickyIn = in
				s.mu.Unlock()
			}
			s.setPods(svc, states)
			written[svc] = states
		}
		// The fault lasts until the proxy uses what was written: the API server's acceptance is
		// not the proxy's (after an API server restart its informers may still be backing off).
		wrote := time.Now()
		eventually(t, 90*time.Second, kind+": the proxy never used the endpoints written", func() error {
			return s.proxyUses(written)
		})
		s.mu.Lock()
		prev := ""
		if len(s.windows) > 0 {
			prev = s.windows[len(s.windows)-1].kind
		}
		s.applied = append(s.applied, propagation{prev, time.Since(wrote)})
		s.mu.Unlock()
		if d := time.Since(wrote); d > time.Second {
			t.Logf("%s: %s: the proxy used the endpoints written %v after the write (the fault before: %s)", s.mode, kind, d.Round(time.Millisecond), prev)
		}
	case "natflush":
		// Every nat rule the proxy had programmed (the node namespace is this test's alone):
		// portal rules, and the kernel path's chains while the web Service is on it; but not
		// those of another test's Services on the shared API server, which may be deleted
		// meanwhile (the bind-mode soak ending: "12 rules missing", all of its namespace).
		before := natRules(t, s.n.bed.Node)
		for r := range before {
			if strings.Contains(r, `--comment "kpp-`) && !strings.Contains(r, `--comment "`+s.n.namespace+"/") {
				delete(before, r)
			}
		}
		t.Logf("%s: nat flush at %s", s.mode, time.Now().Format("15:04:05.000"))
		s.n.bed.Node.MustExec(t, "iptables", "-w", "5", "-t", "nat", "-F")
		// The window lasts until the next periodic sync (--iptables-sync-period=1s) has seen
		// the flush and restored every rule; soakNatFlushMaxWindow bounds it. The wait is
		// longer so that a slow repair is measured rather than cut off.
		eventually(t, 90*time.Second, "the nat rules were never restored after the flush", func() error {
			now := natRules(t, s.n.bed.Node)
			var missing []string
			for r := range before {
				if !now[r] {
					missing = append(missing, r)
				}
			}
			if len(missing) > 0 {
				slices.Sort(missing)
				return fmt.Errorf("%d rules missing: %v", len(missing), missing)
			}
			return nil
		})
	case "datapath":
		to := "kernel"
		if s.webPath == "kernel" {
			to = "proxy"
		}
		// The proxy ports the web Service leaves: closed once the kernel chains are in (and, for
		// UDP, its redirected conntrack entries cleared first, which takes a moment).
		var leaving []uint16
		if to == "kernel" {
			leaving = rules(t, s.n.bed.Node).ofService(s.web.Namespace, s.web.Name).proxyPorts()
		}
		t.Logf("%s: web to the %s path at %s", s.mode, to, time.Now().Format("15:04:05.000"))
		s.annotateWeb(to)
		// The fault lasts until the proxy has moved both ports and closed the sockets they
		// leave (the API server may be backing its informers off after a restart, as for churn).
		eventually(t, 90*time.Second, "the web Service never reached the "+to+" path", func() error {
			if err := s.webPathInForce(to); err != nil {
				return err
			}
			open := listening(t, s.n.bed.Node)
			for _, p := range leaving {
				if open[p] {
					return fmt.Errorf("the proxy port %d the web Service left still listens", p)
				}
			}
			return nil
		})
		s.webPath = to
	case "apiserver":
		if err := controlPlane.RestartAPIServer(t.Context()); err != nil {
			t.Fatal(err)
		}
	case "etcd":
		if err := controlPlane.RestartEtcd(t.Context()); err != nil {
			t.Fatal(err)
		}
	case "fdexhaust":
		pid := strconv.Itoa(s.proxy.Pid())
		open := s.fds()
		old := strings.TrimSpace(s.n.bed.Node.MustExec(t, "prlimit", "--pid", pid, "--nofile", "--noheadings", "--output=SOFT,HARD"))
		f := strings.Fields(old)
		if len(f) != 2 {
			t.Fatalf("prlimit of %s: %q", pid, old)
		}
		s.n.bed.Node.MustExec(t, "prlimit", "--pid", pid, fmt.Sprintf("--nofile=%d:%s", open+2, f[1]))
		time.Sleep(1500 * time.Millisecond) // the fault: clients meet a proxy out of descriptors
		s.n.bed.Node.MustExec(t, "prlimit", "--pid", pid, "--nofile="+f[0]+":"+f[1])
	}
	s.mu.Lock()
	s.windows = append(s.windows, soakWindow{kind, start, time.Now()})
	s.active = ""
	if kind == "sigkill" || kind == "handover" || kind == "churn" || kind == "terminating" {
		s.moved, s.movedBy = time.Now(), kind // a new process or new endpoints: a client's affinity may move
	}
	s.mu.Unlock()
	t.Logf("%s: %s took %v", s.mode, kind, time.Since(start).Round(time.Millisecond))
}

// setPods is clusterNode.setPods retried until the API server takes it (it may be restarting).
func (s *soak) setPods(svc *corev1.Service, states map[int]podState) {
	want := sliceOf(svc)
	for i := 1; i <= len(s.n.bed.Pods); i++ {
		st, ok := states[i]
		if !ok {
			continue
		}
		c := discoveryv1.EndpointConditions{Ready: ptr(true), Serving: ptr(true), Terminating: ptr(false)}
		if st == podTerminating {
			c = discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}
		}
		want.Endpoints = append(want.Endpoints, discoveryv1.Endpoint{Addresses: []string{testbed.PodIP(i).String()}, Conditions: c, NodeName: ptr(s.n.name)})
	}
	api := s.n.admin.DiscoveryV1().EndpointSlices(want.Namespace)
	eventually(s.t, 60*time.Second, "apply the EndpointSlice of "+svc.Name, func() error {
		cur, err := api.Get(s.t.Context(), want.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		want.ResourceVersion = cur.ResourceVersion
		_, err = api.Update(s.t.Context(), want, metav1.UpdateOptions{})
		return err
	})
}

// annotateWeb writes the web Service's data-path annotation, retried until the API server takes
// it (it may be restarting).
func (s *soak) annotateWeb(path string) {
	api := s.n.admin.CoreV1().Services(s.web.Namespace)
	eventually(s.t, 60*time.Second, "annotate "+s.web.Name+" with the "+path+" path", func() error {
		cur, err := api.Get(s.t.Context(), s.web.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if cur.Annotations == nil {
			cur.Annotations = map[string]string{}
		}
		cur.Annotations[annotationDataPath] = path
		_, err = api.Update(s.t.Context(), cur, metav1.UpdateOptions{})
		return err
	})
}

// webPathInForce reports whether both ports of the web Service are on path: the proxy's
// /debug/services says so, and the node's nat table jumps to their KUBE-SVC chains (each with
// its endpoints) on the kernel path and has their portal rules on the proxy path, not both.
func (s *soak) webPathInForce(path string) error {
	nat, err := s.n.bed.Node.Exec(s.t.Context(), "iptables-save", "-t", "nat")
	if err != nil {
		return fmt.Errorf("iptables-save: %w\n%s", err, nat)
	}
	for _, p := range []struct {
		name  string
		proto service.Protocol
	}{{"http", service.TCP}, {"dns", service.UDP}} {
		spn := service.ServicePortName{Namespace: s.web.Namespace, Name: s.web.Name, Port: p.name}
		v, err := debugViewOf(s.n, spn.String())
		if err != nil {
			return err
		}
		if v.DataPath != path {
			return fmt.Errorf("%s: /debug/services says path %q", spn, v.DataPath)
		}
		chain := kernel.ServiceChain(kernel.PrefixService, spn, p.proto)
		kernelIn := strings.Contains(string(nat), "-j "+chain) && strings.Contains(string(nat), "-A "+chain+" ")
		portalIn := slices.ContainsFunc(strings.Split(string(nat), "\n"), func(l string) bool {
			return strings.HasPrefix(l, "-A KUBE-PORTALS-CONTAINER ") && strings.Contains(l, `"`+spn.String()+`"`)
		})
		if kernelIn != (path == "kernel") || portalIn != (path == "proxy") {
			return fmt.Errorf("%s on the %s path: nat table has the jump to %s: %v, its portal rule: %v", spn, path, chain, kernelIn, portalIn)
		}
	}
	return nil
}

// natRules is the node's nat table as a set of its "-A" rule lines.
func natRules(t *testing.T, ns *netns.NS) map[string]bool {
	out := map[string]bool{}
	for _, r := range rules(t, ns) {
		if r.table == "nat" {
			out[r.text] = true
		}
	}
	return out
}

// settle waits until every target answers and checks the invariants.
func (s *soak) settle(what string) {
	t := s.t
	t.Helper()
	for name, addr := range s.tcp {
		s.proxy.waitAnswers(t, s.n.bed.Client, addr, what+": "+name+" never answered")
	}
	eventually(t, 10*time.Second, what+": UDP never answered", func() error {
		_, err := whoUDP(s.n.bed.Client, s.udp)
		return err
	})
	switch s.mode {
	case "iptables":
		eventually(t, 10*time.Second, what+": rules of the test's Services", func() error {
			if err := s.webPathInForce(s.webPath); err != nil {
				return err
			}
			rs := rules(t, s.n.bed.Node).of(s.n.namespace)
			if d := rs.duplicates(); len(d) > 0 {
				return fmt.Errorf("duplicate rules: %v", d)
			}
			open := listening(t, s.n.bed.Node)
			// The kernel path's DNAT rules (KUBE-SEP-*) go to the endpoints, not to proxy ports.
			ports := slices.DeleteFunc(rs, func(r rule) bool { return strings.HasPrefix(r.text, "-A "+kernel.PrefixEndpoint) }).proxyPorts()
			want := 4 // web and sticky, http and dns
			if s.webPath == "kernel" {
				want = 2
			}
			if len(ports) < want {
				return fmt.Errorf("proxy ports in the rules: %v, want %d at least (web on the %s path)", ports, want, s.webPath)
			}
			for _, p := range ports {
				if !open[p] {
					return fmt.Errorf("the rules point at proxy port %d, where nothing listens", p)
				}
			}
			return nil
		})
	case "bind":
		for _, svc := range []*corev1.Service{s.web, s.sticky} {
			own := hostPrefix(targetsOf(t, svc).clusterTCP.Addr())
			if got := portalAddrs(t, s.n.bed.Node); !slices.Contains(got, own) {
				t.Errorf("%s: portal addresses %v lack %s", what, got, own)
			}
		}
	}
	now := s.figures(t)
	if s.base == (procFigures{}) {
		s.base = now // a new process: measured before it had clients (or with few)
		return
	}
	fdBound := s.base.fds + 2*now.conns + now.sessions + soakFDSlack
	grBound := s.base.goroutines + now.conns + soakGoroutineSlack
	if now.fds > fdBound || now.goroutines > grBound || now.rss > soakMaxRSS {
		t.Errorf("%s: descriptors %d (bound %d), goroutines %d (bound %d), RSS %d MiB (bound %d) with %d connections and %d UDP sessions live; the process had %d and %d",
			what, now.fds, fdBound, now.goroutines, grBound, now.rss>>20, soakMaxRSS>>20, now.conns, now.sessions, s.base.fds, s.base.goroutines)
		t.Logf("%s: the proxy's descriptors by kind now: %v", what, s.fdKinds())
	}
	s.mu.Lock()
	s.peak.fds, s.peak.goroutines, s.peak.rss = max(s.peak.fds, now.fds), max(s.peak.goroutines, now.goroutines), max(s.peak.rss, now.rss)
	s.mu.Unlock()
}

// procFigures are the proxy's own counts from its /metrics.
type procFigures struct{ fds, goroutines, rss, conns, sessions int }

func (s *soak) figures(t *testing.T) procFigures {
	var f procFigures
	eventually(t, 10*time.Second, "scrape /metrics", func() error {
		code, body, err := httpGet(s.n.bed.Node, "http://"+metricsAddr+"/metrics")
		if err != nil || code != 200 {
			return fmt.Errorf("GET /metrics: %d, %v", code, err)
		}
		for _, m := range []struct {
			series string
			into   *int
		}{{"process_open_fds", &f.fds}, {"go_goroutines", &f.goroutines}, {"process_resident_memory_bytes", &f.rss},
			{"kube_portal_proxy_tcp_connections_active", &f.conns}, {"kube_portal_proxy_udp_sessions_active", &f.sessions}} {
			v, ok := metricSum(body, m.series)
			if !ok {
				return fmt.Errorf("no %s in /metrics", m.series)
			}
			*m.into = int(v)
		}
		return nil
	})
	return f
}

// metricSum adds up every series of a metric in a Prometheus text exposition.
func metricSum(exposition, name string) (float64, bool) {
	sum, found := 0.0, false
	for _, line := range strings.Split(exposition, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (!strings.HasPrefix(rest, " ") && !strings.HasPrefix(rest, "{")) {
			continue
		}
		f := strings.Fields(rest[strings.LastIndex(rest, "}")+1:])
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			sum, found = sum+v, true
		}
	}
	return sum, found
}

// fds counts the proxy's open descriptors from /proc (the fault must not wait for a scrape).
func (s *soak) fds() int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", s.proxy.Pid()))
	if err != nil {
		s.t.Fatalf("descriptors of the proxy: %v", err)
	}
	return len(ents)
}

// fdKinds counts the proxy's open descriptors by what they are ("socket", "anon_inode:[io_uring]",
// a file's directory), for a descriptor bound that breaks.
func (s *soak) fdKinds() map[string]int {
	dir := fmt.Sprintf("/proc/%d/fd", s.proxy.Pid())
	ents, err := os.ReadDir(dir)
	if err != nil {
		return map[string]int{err.Error(): 1}
	}
	out := map[string]int{}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		switch {
		case err != nil:
			out["gone"]++
		case strings.HasPrefix(target, "socket:"):
			out["socket"]++
		case strings.HasPrefix(target, "anon_inode:"):
			out[target]++
		default:
			out[filepath.Dir(target)]++
		}
	}
	return out
}

func (s *soak) fail(target string, start time.Time, err error) {
	s.mu.Lock()
	s.failures = append(s.failures, soakFailure{target, start, time.Now(), err, false})
	s.mu.Unlock()
}

// begin records that a client's attempt (a request, a UDP try, a stream step) starts now, and
// returns now; idle that it ended. waitQuiet reads them.
func (s *soak) begin(client string) time.Time {
	now := time.Now()
	s.mu.Lock()
	s.inflight[client] = now
	s.mu.Unlock()
	return now
}

func (s *soak) idle(client string) {
	s.mu.Lock()
	delete(s.inflight, client)
	s.mu.Unlock()
}

// waitQuiet waits until no attempt begun at or before the end of the last fault's window is
// still in flight, so that no attempt overlaps two windows: one failing by its timeout after a nat
// flush would otherwise also be charged to the next fault, and a rule that charged it to only
// one of them would let the looser excuse it. Attempts end within soakTimeout.
func (s *soak) waitQuiet() {
	s.mu.Lock()
	var last time.Time
	if len(s.windows) > 0 {
		last = s.windows[len(s.windows)-1].to
	}
	s.mu.Unlock()
	eventually(s.t, soakTimeout+5*time.Second, "attempts in flight during the last fault never ended", func() error {
		s.mu.Lock()
		defer s.mu.Unlock()
		for c, at := range s.inflight {
			if !at.After(last) {
				return fmt.Errorf("%s: an attempt begun at %s still in flight", c, at.Format("15:04:05.000"))
			}
		}
		return nil
	})
}

func (s *soak) count(target string, start time.Time) {
	s.mu.Lock()
	s.attempts[target]++
	if time.Since(start) > time.Second {
		s.slow++
	}
	s.mu.Unlock()
}

// shortTCP makes a new connection to addr every 20 ms until stop.
func (s *soak) shortTCP(stop <-chan struct{}, name string, addr netip.AddrPort) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	last := ""
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		start := s.begin(name)
		pod, err := testbed.Who(s.n.bed.Client, addr, soakTimeout)
		s.idle(name)
		s.count(name, start)
		if err != nil {
			s.fail(name, start, err)
			continue
		}
		if name == "sticky cluster IP" {
			s.mu.Lock()
			s.stickyTo[pod]++
			if last != "" && pod != last {
				if cause := s.moveCause(last, start); cause != "" {
					s.moves[cause]++
				} else {
					s.switches++
					s.t.Logf("%s: ClientIP affinity moved from %s to %s by a request at %s (answered in %v), no new process and %s still in use (fault under way: %q, last: %s %v before; faults so far: %d)",
						s.mode, last, pod, start.Format("15:04:05.000"), time.Since(start).Round(time.Millisecond), last, s.active, s.movedBy, time.Since(s.moved).Round(time.Millisecond), len(s.windows))
				}
			}
			s.mu.Unlock()
			last = pod
		}
	}
}

// shortUDP sends a query from a new socket (a new session) every 20 ms until stop, and, as a
// resolver does, asks again after a second without an answer, three times in all. Each lost
// answer is recorded as a failure (the rule bounds them as it bounds failed requests); a query
// whose three tries are all lost is counted apart for the report.
func (s *soak) shortUDP(stop <-chan struct{}) {
	const name = "web cluster IP udp"
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		start := time.Now()
		var err error
		for range 3 {
			try := s.begin(name)
			_, err = testbed.WhoUDP(s.n.bed.Client, s.udp, time.Second)
			s.idle(name)
			if err == nil {
				break
			}
			s.mu.Lock()
			s.failures = append(s.failures, soakFailure{name, try, time.Now(), err, true})
			s.mu.Unlock()
		}
		s.count(name, start)
		if err != nil {
			s.mu.Lock()
			s.udpFailed++
			s.mu.Unlock()
		}
	}
}

// moveCause explains a ClientIP client's move off the pod it had, for a request made at start: a
// new process (sigkill or handover under way, or over less than 2 s ago: the new process's table
// is empty), an endpoint change (churn, terminating) that took that pod out of the ready set, or a
// dial that failed for want of a descriptor (the request was in flight during fdexhaust). ""
// when none: the proxy moved a client it should have kept. Called with mu held.
func (s *soak) moveCause(from string, start time.Time) string {
	for i := len(s.windows) - 1; i >= 0 && !s.windows[i].to.Before(start); i-- {
		if s.windows[i].kind == "fdexhaust" {
			return "dial without a descriptor re-picked (fdexhaust)"
		}
	}
	kind := s.active
	if kind == "" && time.Since(s.moved) < 2*time.Second {
		kind = s.movedBy
	}
	switch kind {
	case "sigkill", "handover":
		return "new process (" + kind + ")"
	case "churn", "terminating":
		if !s.stickyIn[from] {
			return "pod left the ready set (" + kind + ")"
		}
	case "fdexhaust":
		// A dial that finds no descriptor backs off while its attempt's time lasts, then fails
		// like any dial and the next attempt re-picks (legacy behaviour: a failed dial resets
		// the client's affinity). Reported apart, as the failures of this window are.
		if s.active == "fdexhaust" {
			return "dial without a descriptor re-picked (fdexhaust)"
		}
	}
	return ""
}

// proxyUses reports whether the proxy's balancer (its /debug/services) uses, for every port of
// each Service, exactly the ready endpoints of the states written, and lists exactly those written.
func (s *soak) proxyUses(written map[*corev1.Service]map[int]podState) error {
	code, body, err := httpGet(s.n.bed.Node, "http://"+metricsAddr+"/debug/services?format=json")
	if err != nil || code != 200 {
		return fmt.Errorf("GET /debug/services: %d %v", code, err)
	}
	var views []struct {
		Name      string `json:"name"`
		Endpoints []struct {
			Address string `json:"address"`
			InUse   bool   `json:"inUse"`
		} `json:"endpoints"`
	}
	if err := json.Unmarshal([]byte(body), &views); err != nil {
		return fmt.Errorf("/debug/services: %w", err)
	}
	for svc, states := range written {
		var listed, ready []string
		for i, st := range states {
			listed = append(listed, testbed.PodIP(i).String())
			if st == podReady {
				ready = append(ready, testbed.PodIP(i).String())
			}
		}
		slices.Sort(listed)
		slices.Sort(ready)
		ports := 0
		for _, v := range views {
			if !strings.HasPrefix(v.Name, svc.Namespace+"/"+svc.Name+":") {
				continue
			}
			ports++
			var gotListed, gotUsed []string
			for _, e := range v.Endpoints {
				ap, err := netip.ParseAddrPort(e.Address)
				if err != nil {
					return fmt.Errorf("%s: endpoint %q: %w", v.Name, e.Address, err)
				}
				gotListed = append(gotListed, ap.Addr().String())
				if e.InUse {
					gotUsed = append(gotUsed, ap.Addr().String())
				}
			}
			slices.Sort(gotListed)
			slices.Sort(gotUsed)
			if !slices.Equal(gotListed, listed) || !slices.Equal(gotUsed, ready) {
				return fmt.Errorf("%s: endpoints %v, in use %v; want %v, in use %v", v.Name, gotListed, gotUsed, listed, ready)
			}
		}
		if ports == 0 {
			return fmt.Errorf("no port of %s/%s in /debug/services", svc.Namespace, svc.Name)
		}
	}
	return nil
}

// stream keeps a connection to addr exchanging a line every 50 ms; each connection lives about two
// seconds, then closes cleanly and another opens (a keep-alive client that recycles connections).
func (s *soak) stream(stop <-chan struct{}, addr netip.AddrPort) {
	const name = "keep-alive stream"
	for {
		select {
		case <-stop:
			return
		default:
		}
		start := s.begin(name)
		c, err := testbed.Dial(s.n.bed.Client, addr, soakTimeout)
		if err != nil {
			s.idle(name)
			s.fail(name, start, err)
			time.Sleep(50 * time.Millisecond) // a client's reconnect back-off
			continue
		}
		at, err := s.streamOne(stop, c)
		s.idle(name)
		if err != nil {
			s.fail(name, at, err)
		} else {
			s.mu.Lock()
			s.streams++
			s.mu.Unlock()
		}
		c.Close()
	}
}

// streamOne runs one connection of the stream; on failure it returns when the failing step began.
func (s *soak) streamOne(stop <-chan struct{}, c net.Conn) (time.Time, error) {
	r := bufio.NewReader(c)
	start := time.Now()
	_ = c.SetDeadline(start.Add(soakTimeout))
	if _, err := r.ReadString('\n'); err != nil {
		return start, fmt.Errorf("greeting: %w", err)
	}
	for i := range 40 {
		select {
		case <-stop:
			return time.Time{}, nil
		case <-time.After(50 * time.Millisecond): // the stream's pace
		}
		start = s.begin("keep-alive stream")
		_ = c.SetDeadline(start.Add(soakTimeout))
		msg := fmt.Sprintf("ping %d", i)
		if _, err := fmt.Fprintf(c, "%s\n", msg); err != nil {
			return start, fmt.Errorf("send %q: %w", msg, err)
		}
		got, err := r.ReadString('\n')
		s.count("keep-alive stream", start)
		if err != nil || strings.TrimSpace(got) != msg {
			return start, fmt.Errorf("echo of %q: %q, %w", msg, got, err)
		}
	}
	start = s.begin("keep-alive stream")
	_ = c.(*net.TCPConn).CloseWrite()
	if rest, err := r.ReadString('\n'); rest != "" || err == nil {
		return start, fmt.Errorf("after the FIN: %q, %v; want a clean EOF", rest, err)
	}
	return time.Time{}, nil
}

// report logs the figures per fault kind (its windows, from the fault's start until the proxy
// served again, and the failures charged to them by target and cause) and applies the rule
// (classifySoak): it fails the test for every breach, logging each failure behind one with the
// proxy's lines around it, and for every ClientIP affinity move nothing explains.
func (s *soak) report() {
	t := s.t
	s.mu.Lock()
	defer s.mu.Unlock()
	total := sumValues(s.attempts)
	v := classifySoak(s.windows, s.failures)
	byKind := map[string][]soakCharge{}
	for _, c := range v.charges {
		byKind[c.window.kind] = append(byKind[c.window.kind], c)
	}
	lost := 0
	for _, f := range s.failures {
		if f.lost {
			lost++
		}
	}
	t.Logf("%s soak: %d requests/exchanges %v, %d slower than 1s, %d keep-alive connections finished cleanly; %d faults %v",
		s.mode, total, s.attempts, s.slow, s.streams, sumValues(s.faults), s.faults)
	t.Logf("%s soak: %d failures and lost UDP answers (%d lost answers, %d queries lost all three tries)", s.mode, len(s.failures), lost, s.udpFailed)
	for _, f := range soakFaults {
		cs := byKind[f.kind]
		if len(cs) == 0 {
			continue
		}
		var ls []time.Duration
		charged, excused, most := map[string]int{}, 0, 0
		for _, c := range cs {
			ls = append(ls, c.window.to.Sub(c.window.from).Round(time.Millisecond))
			for _, f := range append(slices.Clone(c.charged), c.late...) {
				charged[f.target+" "+failureKind(f.err)]++
			}
			excused += len(c.excused)
			most = max(most, len(c.charged)+len(c.late))
		}
		slices.Sort(ls)
		r := soakRuleOf(f.kind)
		if r.excusedFor > 0 {
			t.Logf("%s soak: %-11s %3d windows, median %v, max %v; excused (begun within %v) %d; not excused %d %v",
				s.mode, f.kind+":", len(cs), ls[len(ls)/2], ls[len(ls)-1], r.excusedFor, excused, sumValues(charged), charged)
			continue
		}
		t.Logf("%s soak: %-11s %3d windows, median %v, max %v (bound %v); charged %d, at most %d in one window (bound %d + %d lost answers) %v",
			s.mode, f.kind+":", len(cs), ls[len(ls)/2], ls[len(ls)-1], r.maxWindow, sumValues(charged), most, r.maxFailures, r.maxLost, charged)
	}
	if kills := byKind["sigkill"]; len(kills) > 0 {
		var starts, ends []time.Duration
		failing := 0
		for _, c := range kills {
			var start, end time.Duration
			for _, f := range append(slices.Clone(c.excused), c.late...) {
				start, end = max(start, f.start.Sub(c.window.from)), max(end, f.end.Sub(c.window.from))
			}
			if start > 0 || end > 0 {
				failing++
			}
			starts, ends = append(starts, start), append(ends, end)
		}
		slices.Sort(starts)
		slices.Sort(ends)
		n := len(kills)
		t.Logf("%s soak: SIGKILL: %d of %d kills saw failures; kill to the last failing attempt's start: median %v, max %v; to the last failure's end: median %v, max %v",
			s.mode, failing, n, starts[n/2].Round(time.Millisecond), starts[n-1].Round(time.Millisecond), ends[n/2].Round(time.Millisecond), ends[n-1].Round(time.Millisecond))
	}
	t.Logf("%s soak: %d failures and lost answers in flight during no fault", s.mode, len(v.outside))
	t.Logf("%s soak: peak at a settle: %d descriptors, %d goroutines, RSS %d MiB", s.mode, s.peak.fds, s.peak.goroutines, s.peak.rss>>20)
	if n := len(s.applied); n > 0 {
		ds := make([]time.Duration, n)
		slow := map[string]int{}
		for i, p := range s.applied {
			ds[i] = p.took
			if p.took > time.Second {
				slow["after "+p.after]++
			}
		}
		slices.Sort(ds)
		t.Logf("%s soak: %d endpoint changes, used by the proxy after the API write: median %v, max %v; over 1s: %v",
			s.mode, n, ds[n/2].Round(time.Millisecond), ds[n-1].Round(time.Millisecond), slow)
	}
	t.Logf("%s soak: ClientIP affinity answers by pod %v; moves by cause %v; %d unexplained", s.mode, s.stickyTo, s.moves, s.switches)

	for _, b := range v.breaches {
		t.Errorf("%s soak: %s", s.mode, b)
	}
	// The failures behind the breaches, each with the proxy's lines around it (20 at most).
	var shown []soakFailure
	for _, c := range v.charges {
		r := soakRuleOf(c.window.kind)
		shown = append(shown, c.late...)
		if r.overBound(c.charged) {
			shown = append(shown, c.charged...)
		}
	}
	shown = append(shown, v.outside...)
	sort.Slice(shown, func(i, j int) bool { return shown[i].start.Before(shown[j].start) })
	shown = slices.CompactFunc(shown, func(a, b soakFailure) bool { return a.start.Equal(b.start) && a.target == b.target })
	for i, f := range shown {
		if i == 20 {
			t.Logf("... and %d more", len(shown)-20)
			break
		}
		t.Logf("failure at %s (%v, in flight during: %s): %s: %v", f.start.Format("15:04:05.000"), f.end.Sub(f.start).Round(time.Millisecond),
			s.windowsOf(f), f.target, f.err)
		s.logAround(f)
	}
	if s.switches > 0 {
		t.Errorf("ClientIP affinity: %d answers came from another pod with no new process and the client's pod still in use", s.switches)
	}
}

// windowsOf names the fault windows a failure was in flight during, "none" when none.
func (s *soak) windowsOf(f soakFailure) string {
	var out []string
	for _, w := range s.windows {
		if w.overlaps(f) {
			out = append(out, fmt.Sprintf("%s at %s", w.kind, w.from.Format("15:04:05.000")))
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}

func sumValues(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func windowLengths(ws []soakWindow) []time.Duration {
	out := make([]time.Duration, len(ws))
	for i, w := range ws {
		out[i] = w.to.Sub(w.from).Round(time.Millisecond)
	}
	return out
}

func mapValues[K comparable, V any](m map[K]V) []V {
	out := make([]V, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// logAround logs, for an unexplained failure, what each proxy process logged from a second
// before the attempt until a second after it (its own reset or dial lines, a sync, a hand-over
// step), at most 40 lines a process, UDP session lines left out.
func (s *soak) logAround(f soakFailure) {
	from, to := f.start.Add(-time.Second).Truncate(time.Second), f.end.Add(time.Second)
	for _, p := range s.procs {
		var out []string
		for line := range strings.SplitSeq(p.LogTail(1<<20), "\n") {
			at, ok := logTime(line)
			if !ok || at.Before(from) || at.After(to) || strings.Contains(line, "session opened") || strings.Contains(line, "session ended") {
				continue
			}
			if out = append(out, line); len(out) == 40 {
				break
			}
		}
		if len(out) > 0 {
			s.t.Logf("proxy pid %d around %s:\n%s", p.Pid(), f.start.Format("15:04:05.000"), strings.Join(out, "\n"))
		}
	}
}

// logTime is the time of a proxy log line, logrus's time="..." (to the second); false for other
// lines (klog's informer lines).
func logTime(line string) (time.Time, bool) {
	if i := strings.Index(line, `time="`); i >= 0 {
		rest := line[i+len(`time="`):]
		if j := strings.IndexByte(rest, '"'); j > 0 {
			t, err := time.Parse(time.RFC3339Nano, rest[:j])
			return t, err == nil
		}
	}
	return time.Time{}, false
}
