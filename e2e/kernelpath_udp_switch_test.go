package e2e

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The UDP side of the data-path annotation, with real sockets and real iptables in the test's
// namespaces. Address plan: internal/testbed (pods 10.244.<i>.10 answer every datagram on UDP
// 5353 with "pod<i> <the datagram>"; the client 172.30.0.2 sends to the cluster IP, port 53,
// through the node).

// udpPhase counts what the UDP clients saw while one data path was in force (or while switching).
type udpPhase struct {
	freshOK, freshFailed atomic.Int64 // a new socket, hence a new flow, per query
	mu                   sync.Mutex
	long                 map[string]*longCount // per long-lived flow (one socket, one source port)
	errs                 []string
}

type longCount struct {
	ok, failed int
	refused    int // of failed: ECONNREFUSED, an ICMP port unreachable came back
	pods       map[string]int
}

func (c *longCount) String() string {
	return fmt.Sprintf("%d answered, %d failed (%d refused), pods %v", c.ok, c.failed, c.refused, c.pods)
}

func newUDPPhase() *udpPhase { return &udpPhase{long: map[string]*longCount{}} }

// longOf returns flow's counts in the phase; the caller holds ph.mu.
func (ph *udpPhase) longOf(flow string) *longCount {
	c := ph.long[flow]
	if c == nil {
		c = &longCount{pods: map[string]int{}}
		ph.long[flow] = c
	}
	return c
}

func (ph *udpPhase) longAnswered(flow, pod string) {
	ph.mu.Lock()
	defer ph.mu.Unlock()
	c := ph.longOf(flow)
	c.ok++
	c.pods[pod]++
}

func (ph *udpPhase) longFailed(flow string, err error) {
	ph.mu.Lock()
	c := ph.longOf(flow)
	c.failed++
	if errors.Is(err, syscall.ECONNREFUSED) {
		c.refused++
	}
	ph.mu.Unlock()
	ph.fail("long flow %s: %v", flow, err)
}

// counts returns flow's counts so far (a copy).
func (ph *udpPhase) counts(flow string) longCount {
	ph.mu.Lock()
	defer ph.mu.Unlock()
	c := *ph.longOf(flow)
	c.pods = maps.Clone(c.pods)
	return c
}

func (ph *udpPhase) fail(format string, args ...any) {
	ph.mu.Lock()
	defer ph.mu.Unlock()
	if len(ph.errs) < 20 {
		ph.errs = append(ph.errs, fmt.Sprintf(format, args...))
	}
}

// redirectTo finds the proxy port the portal rules steer a service port to.
var redirectTo = regexp.MustCompile(`-j REDIRECT --to-ports (\d+)`)

// TestDataPathUDPSwitchesLive switches a UDP service port kernel -> proxy -> kernel while
// long-lived client flows send a datagram every 20 ms from one socket each (from-kernel, opened
// on the kernel path; from-proxy, opened on the proxy path) and another client opens a new socket
// (a new flow) every 50 ms. After each switch the rules and sockets are as wanted (the KUBE-SVC
// jump and no portal rule on the kernel path, with the old proxy socket closed; the portal
// REDIRECT to a listening proxy socket on the proxy path), and every client is answered on both
// sides of each switch: from-kernel keeps its pod while the port leaves the kernel path (its
// conntrack entry still DNATs it there, as an established TCP connection stays); from-proxy is
// never refused on the move back to the kernel path (the proxier clears its conntrack entry, then
// closes the proxy socket it was steered to) and loses at most the one reply in flight then. The /metrics series of the KUBE-SEP counters (service_port label)
// count the new flows of the kernel path.
func TestDataPathUDPSwitchesLive(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 3)
	svc := n.annotatedService(t, "web", map[string]string{annotationDataPath: "kernel"})
	n.setEndpoints(t, svc, 1, 2, 3)
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterUDP
	name := service.ServicePortName{Namespace: svc.Namespace, Name: "web", Port: "dns"}
	svcChain := kernel.ServiceChain(kernel.PrefixService, name, service.UDP)
	comment := `--comment "` + name.String() + `"`

	eventually(t, 30*time.Second, "the kernel-path UDP service answering", func() error {
		if err := proxy.exited(); err != nil {
			return err
		}
		_, err := whoUDP(n.bed.Client, addr)
		return err
	})

	listening := func(port string) (bool, error) {
		out, err := n.bed.Node.Exec(t.Context(), "ss", "-Hnlu")
		if err != nil {
			return false, err
		}
		return regexp.MustCompile(`:` + port + `\s`).Match(out), nil
	}
	// inForce waits until path is in force for the dns port and returns the proxy port (proxy
	// path) or "" (kernel path); oldProxyPort, if set, must no longer be listening.
	inForce := func(path, oldProxyPort string) string {
		t.Helper()
		var proxyPort string
		eventually(t, 30*time.Second, "the "+path+" path in force for "+name.String(), func() error {
			v, err := debugViewOf(n, name.String())
			if err != nil {
				return err
			}
			if v.DataPath != path {
				return fmt.Errorf("/debug/services says path %q", v.DataPath)
			}
			rs := rules(t, n.bed.Node)
			kernelJump := len(rs.in(kernel.ChainServices).filter("-j "+svcChain)) > 0
			portals := rs.in("KUBE-PORTALS-CONTAINER").filter(comment)
			switch {
			case kernelJump != (path == "kernel"):
				return fmt.Errorf("path %s, yet the jump to %s in KUBE-SERVICES is there: %v", path, svcChain, kernelJump)
			case (len(portals) > 0) != (path == "proxy"):
				return fmt.Errorf("path %s, yet portal rules of %s: %q", path, name, portals.texts())
			}
			if path == "proxy" {
				m := redirectTo.FindStringSubmatch(portals[0].text)
				if m == nil {
					return fmt.Errorf("portal rule %q redirects nowhere", portals[0].text)
				}
				proxyPort = m[1]
				if ok, err := listening(proxyPort); err != nil || !ok {
					return fmt.Errorf("the portal steers to UDP port %s, which nothing listens on (%v)", proxyPort, err)
				}
			}
			if oldProxyPort != "" {
				if ok, err := listening(oldProxyPort); err != nil || ok {
					return fmt.Errorf("on the kernel path the old proxy socket (UDP %s) is still open (%v)", oldProxyPort, err)
				}
			}
			return nil
		})
		return proxyPort
	}

	phases := []*udpPhase{newUDPPhase()}
	var cur atomic.Pointer[udpPhase]
	cur.Store(phases[0])
	enter := func() *udpPhase {
		ph := newUDPPhase()
		phases = append(phases, ph)
		cur.Store(ph)
		return ph
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	// startLong opens a long-lived flow: a datagram every 20 ms from one socket until the end.
	startLong := func(flow string) {
		t.Helper()
		var c net.Conn
		if err := n.bed.Client.Do(func() (err error) {
			c, err = net.Dial("udp", addr.String())
			return err
		}); err != nil {
			t.Fatalf("UDP socket in the client: %v", err)
		}
		wg.Go(func() {
			defer c.Close()
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for i := 0; ; i++ {
				ph := cur.Load()
				if who, err := testbed.Ask(c, flow+"-"+strconv.Itoa(i), requestTimeout); err != nil {
					ph.longFailed(flow, fmt.Errorf("datagram %d: %w", i, err))
				} else {
					ph.longAnswered(flow, who)
				}
				select {
				case <-stop:
					return
				case <-tick.C:
				}
			}
		})
	}
	wg.Go(func() { // a new flow every 50 ms
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			ph := cur.Load()
			if _, err := whoUDP(n.bed.Client, addr); err != nil {
				ph.freshFailed.Add(1)
				ph.fail("new flow %d: %v", i, err)
			} else {
				ph.freshOK.Add(1)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	})
	// settle lets every client be answered a few more times in the phase in force.
	settle := func(ph *udpPhase, flows ...string) {
		t.Helper()
		eventually(t, 30*time.Second, "answers in the phase", func() error {
			for _, f := range flows {
				if c := ph.counts(f); c.ok < 10 {
					return fmt.Errorf("%d answers to the long flow %s", c.ok, f)
				}
			}
			if ph.freshOK.Load() < 10 {
				return fmt.Errorf("%d new-flow answers", ph.freshOK.Load())
			}
			return nil
		})
	}
	annotate := func(path string) { t.Helper(); n.setDataPath(t, svc, path) }

	inForce("kernel", "")
	kernel1 := phases[0]
	startLong("from-kernel") // DNATed to a pod by the kernel chains
	settle(kernel1, "from-kernel")
	toProxy := enter()
	annotate("proxy")
	proxyPort := inForce("proxy", "")
	onProxy := enter()
	startLong("from-proxy") // REDIRECTed to the proxy socket
	settle(onProxy, "from-kernel", "from-proxy")
	// The new flows of the proxy phase were steered to the proxy socket, not DNATed.
	if got := rules(t, n.bed.Node).in("KUBE-PORTALS-CONTAINER").filter(comment).packets(); got == 0 {
		t.Errorf("on the proxy path the portal rule of %s matched no packet", name)
	}
	toKernel := enter()
	annotate("kernel")
	inForce("kernel", proxyPort)
	kernel2 := enter()
	settle(kernel2, "from-kernel", "from-proxy")
	close(stop)
	wg.Wait()

	names := []string{"kernel", "switching to proxy", "proxy", "switching to kernel", "kernel again"}
	for i, ph := range []*udpPhase{kernel1, toProxy, onProxy, toKernel, kernel2} {
		t.Logf("%s: long flows %v; new flows %d answered, %d failed", names[i], ph.long, ph.freshOK.Load(), ph.freshFailed.Load())
		// A new flow is answered at every moment: the proxy socket opens before the portal
		// steers to it, and closes only after the kernel chains are in.
		if ph.freshFailed.Load() > 0 {
			t.Errorf("%s: %d new flows failed:\n%s", names[i], ph.freshFailed.Load(), strings.Join(ph.errs, "\n"))
		}
		// Nor is a long flow ever refused. Moving to the kernel path clears the conntrack
		// entries that steer to the proxy socket before closing it (closing first refused the
		// datagrams sent until the clear was done, in every run): from-proxy's next datagram
		// is DNATed to a pod. A reply the proxy sends after the clear has no entry to give it
		// the cluster IP back, so from-proxy may lose that one datagram, as UDP may.
		for flow, c := range ph.long {
			allowed := 0
			if ph == toKernel && flow == "from-proxy" {
				allowed = 1
			}
			if c.refused > 0 || c.failed > allowed {
				t.Errorf("%s: long flow %s: %v; want no refusal and at most %d lost:\n%s", names[i], flow, c, allowed, strings.Join(ph.errs, "\n"))
			}
		}
	}
	// from-kernel stays on its pod while the port leaves the kernel path (its conntrack entry
	// DNATs it there, as an established TCP connection stays).
	k, p := kernel1.counts("from-kernel"), onProxy.counts("from-kernel")
	if len(k.pods) != 1 || fmt.Sprint(keys(k.pods)) != fmt.Sprint(keys(p.pods)) {
		t.Errorf("the long flow from-kernel's pods: kernel %v, then proxy %v; want one pod, the same", k.pods, p.pods)
	}

	// The KUBE-SEP counters of the UDP port, as /metrics exports them.
	eventually(t, 30*time.Second, "KUBE-SEP counters of "+name.String()+" in /metrics", func() error {
		code, body, err := httpGet(n.bed.Node, "http://"+metricsAddr+"/metrics")
		if err != nil || code != 200 {
			return fmt.Errorf("GET /metrics: %d %v", code, err)
		}
		var sum float64
		var series []string
		for _, line := range strings.Split(body, "\n") {
			if !strings.HasPrefix(line, "kube_portal_proxy_kernel_endpoint_packets_total{") || !strings.Contains(line, `service_port="`+name.String()+`"`) {
				continue
			}
			series = append(series, line)
			if !strings.Contains(line, `protocol="UDP"`) || !strings.Contains(line, `endpoint="10.244.`) {
				return fmt.Errorf("series %q: want protocol UDP and a pod endpoint", line)
			}
			f, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
			if err != nil {
				return fmt.Errorf("series %q: %v", line, err)
			}
			sum += f
		}
		// Each new flow on the kernel path is one DNAT: the counters are read at most every 5 s.
		if want := float64(kernel1.freshOK.Load()); len(series) != 3 || sum < want {
			return fmt.Errorf("series %q: want 3 endpoints with at least %.0f packets (the new flows on the kernel path)", series, want)
		}
		return nil
	})
}

// filter returns the rules whose text contains s.
func (rs ruleSet) filter(s string) ruleSet {
	var out ruleSet
	for _, r := range rs {
		if strings.Contains(r.text, s) {
			out = append(out, r)
		}
	}
	return out
}
