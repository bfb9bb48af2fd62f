package e2e

import (
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
	longOK, longFailed   atomic.Int64 // the one long-lived flow (one socket, one source port)
	freshOK, freshFailed atomic.Int64 // a new socket, hence a new flow, per query
	mu                   sync.Mutex
	longPods             map[string]int
	errs                 []string
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

// TestDataPathUDPSwitchesLive switches a UDP service port kernel -> proxy -> kernel while one
// client flow sends a datagram every 20 ms from the same socket and another client opens a new
// socket (a new flow) every 50 ms. After each switch the rules and sockets are as wanted (the
// KUBE-SVC jump and no portal rule or proxy socket on the kernel path; the portal REDIRECT to a
// listening proxy socket on the proxy path, the old proxy socket closed once back on the kernel
// path), and both clients are answered on both sides of each switch. The long flow keeps its
// endpoint when the port leaves the kernel path (its conntrack entry still DNATs it there, as
// an established TCP connection stays) and is answered again on the kernel path after the proxy
// socket it was steered to is gone (its entry is cleared). The /metrics series of the KUBE-SEP
// counters (service_port label) count the fresh flows.
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

	phases := []*udpPhase{{longPods: map[string]int{}}}
	var cur atomic.Pointer[udpPhase]
	cur.Store(phases[0])
	enter := func() *udpPhase {
		ph := &udpPhase{longPods: map[string]int{}}
		phases = append(phases, ph)
		cur.Store(ph)
		return ph
	}

	var long net.Conn
	if err := n.bed.Client.Do(func() (err error) {
		long, err = net.Dial("udp", addr.String())
		return err
	}); err != nil {
		t.Fatalf("UDP socket in the client: %v", err)
	}
	defer long.Close()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { // the long flow: a datagram every 20 ms from one socket
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			ph := cur.Load()
			who, err := testbed.Ask(long, "long-"+strconv.Itoa(i), requestTimeout)
			if err != nil {
				ph.longFailed.Add(1)
				ph.fail("long flow, datagram %d: %v", i, err)
			} else {
				ph.longOK.Add(1)
				ph.mu.Lock()
				ph.longPods[who]++
				ph.mu.Unlock()
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	})
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
	// settle lets both clients be answered a few more times in the phase in force.
	settle := func(ph *udpPhase) {
		t.Helper()
		eventually(t, 30*time.Second, "answers in the phase", func() error {
			if ph.longOK.Load() < 10 || ph.freshOK.Load() < 10 {
				return fmt.Errorf("%d long-flow and %d new-flow answers", ph.longOK.Load(), ph.freshOK.Load())
			}
			return nil
		})
	}
	annotate := func(path string) {
		t.Helper()
		cur, err := n.admin.CoreV1().Services(svc.Namespace).Get(t.Context(), svc.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cur.Annotations[annotationDataPath] = path
		if _, err := n.admin.CoreV1().Services(svc.Namespace).Update(t.Context(), cur, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	inForce("kernel", "")
	kernel1 := phases[0]
	settle(kernel1)
	toProxy := enter()
	annotate("proxy")
	proxyPort := inForce("proxy", "")
	onProxy := enter()
	settle(onProxy)
	// The new flows of the proxy phase were steered to the proxy socket, not DNATed.
	if got := rules(t, n.bed.Node).in("KUBE-PORTALS-CONTAINER").filter(comment).packets(); got == 0 {
		t.Errorf("on the proxy path the portal rule of %s matched no packet", name)
	}
	toKernel := enter()
	annotate("kernel")
	inForce("kernel", proxyPort)
	kernel2 := enter()
	settle(kernel2)
	close(stop)
	wg.Wait()

	names := []string{"kernel", "switching to proxy", "proxy", "switching to kernel", "kernel again"}
	for i, ph := range []*udpPhase{kernel1, toProxy, onProxy, toKernel, kernel2} {
		t.Logf("%s: long flow %d answered, %d failed (pods %v); new flows %d answered, %d failed",
			names[i], ph.longOK.Load(), ph.longFailed.Load(), ph.longPods, ph.freshOK.Load(), ph.freshFailed.Load())
		// A new flow is answered at every moment: the proxy socket opens before the portal
		// steers to it, and closes only after the kernel chains are in.
		if ph.freshFailed.Load() > 0 || (i != 1 && i != 3 && ph.longFailed.Load() > 0) {
			t.Errorf("%s: failures:\n%s", names[i], strings.Join(ph.errs, "\n"))
		}
	}
	// Moving to the kernel path closes the proxy socket, then clears the flow's conntrack entry
	// (proxier.closeRetired): a datagram of the long flow sent between the two is refused. At
	// most that one.
	if f := toKernel.longFailed.Load(); f > 1 {
		t.Errorf("switching to kernel: the long flow failed %d times, want at most 1:\n%s", f, strings.Join(toKernel.errs, "\n"))
	}
	if f := toProxy.longFailed.Load(); f > 0 {
		t.Errorf("switching to proxy: the long flow failed %d times:\n%s", f, strings.Join(toProxy.errs, "\n"))
	}
	// The long flow stays on its endpoint while the port leaves the kernel path.
	if len(kernel1.longPods) != 1 || fmt.Sprint(keys(kernel1.longPods)) != fmt.Sprint(keys(onProxy.longPods)) {
		t.Errorf("the long flow's pods: kernel %v, then proxy %v; want one pod, the same", kernel1.longPods, onProxy.longPods)
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
