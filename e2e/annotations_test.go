package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// Per-service annotations (portal-proxy.kubernetes.io/...) against the real API server: one test
// per annotation. Address plan: internal/testbed (pods 10.244.<i>.10 serving TCP 8080, greeting
// with "pod<i>"; the client pod's namespace dials the cluster IP).

// annotatedService creates the web service (TCP http, UDP dns) with the given annotations.
// setDataPath moves a Service between the data paths with its data-path annotation.
func (n *clusterNode) setDataPath(t *testing.T, svc *corev1.Service, path string) {
	t.Helper()
	cur, err := n.admin.CoreV1().Services(svc.Namespace).Get(t.Context(), svc.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if cur.Annotations == nil {
		cur.Annotations = map[string]string{}
	}
	cur.Annotations[annotationDataPath] = path
	if _, err := n.admin.CoreV1().Services(svc.Namespace).Update(t.Context(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (n *clusterNode) annotatedService(t *testing.T, name string, annotations map[string]string) *corev1.Service {
	t.Helper()
	return createService(t, n.admin, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.namespace, Annotations: annotations},
		Spec:       webSpec(corev1.ServiceTypeClusterIP),
	})
}

// podState is an endpoint's conditions in a slice written by setPods.
type podState int

const (
	podReady       podState = iota
	podTerminating          // terminating, still serving (a pod in its grace period)
)

// setPods writes svc's slice with pod i in state states[i], each naming its Pod (targetRef
// <namespace>/web-<i>) and this node, as the endpoint slice controller would.
func (n *clusterNode) setPods(t *testing.T, svc *corev1.Service, states map[int]podState) {
	t.Helper()
	s := sliceOf(svc)
	for i := 1; i <= len(n.bed.Pods); i++ {
		st, ok := states[i]
		if !ok {
			continue
		}
		c := discoveryv1.EndpointConditions{Ready: ptr(true), Serving: ptr(true), Terminating: ptr(false)}
		if st == podTerminating {
			c = discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}
		}
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses: []string{testbed.PodIP(i).String()}, Conditions: c, NodeName: ptr(n.name),
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: svc.Namespace, Name: fmt.Sprintf("web-%d", i)},
		})
	}
	applySlice(t, n.admin, s)
}

// onlyFrom waits until new connections to addr are answered by want alone (the proxy applied a
// change of the rotation).
func onlyFrom(t *testing.T, n *clusterNode, addr netip.AddrPort, want string) {
	t.Helper()
	eventually(t, 30*time.Second, "new connections only to "+want, func() error {
		got := tally(t, whoTCP, n.bed.Client, addr, 4)
		if got[want] != 4 {
			return fmt.Errorf("answers %v", got)
		}
		return nil
	})
}

// accessLines reads the proxy's JSON log and returns the access log lines of service svc.
func accessLines(t *testing.T, p *proxyProcess, svc string) []map[string]any {
	t.Helper()
	f, err := os.Open(p.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["access"] != nil && m["service"] == svc {
			out = append(out, m)
		}
	}
	return out
}

// readEnd reads from the kept connection until it ends, returning the error (io.EOF for a FIN).
func (k *keptConn) readEnd(timeout time.Duration) error {
	_ = k.c.SetReadDeadline(time.Now().Add(timeout))
	_, err := io.Copy(io.Discard, k.r)
	if err == nil {
		return io.EOF
	}
	return err
}

// TestDrainTimeoutAnnotation: with --drain-removed-endpoints on, a Service annotated drain-timeout
// keeps a connection to a pod that turned terminating (but serving) open until the deadline, then
// closes it with a FIN (the client reads EOF, not a reset); the access log line says
// drain-timeout and names the pod and node. A Service without the annotation follows the flag,
// which no longer resets a pod that is still serving: only its removal does.
func TestDrainTimeoutAnnotation(t *testing.T) {
	t.Parallel()
	const drain = 4 * time.Second
	n := newClusterNode(t, 2)
	drained := n.annotatedService(t, "drained", map[string]string{
		"portal-proxy.kubernetes.io/drain-timeout": drain.String(), "portal-proxy.kubernetes.io/access-log": "true"})
	flagged := n.annotatedService(t, "flagged", nil)
	n.setPods(t, drained, map[int]podState{1: podReady, 2: podReady})
	n.setPods(t, flagged, map[int]podState{1: podReady, 2: podReady})
	proxy := n.startProxy(t, "--drain-removed-endpoints", "--log-format=json")
	dAddr, fAddr := targetsOf(t, drained).clusterTCP, targetsOf(t, flagged).clusterTCP
	proxy.waitAnswers(t, n.bed.Client, dAddr, "the drained service never answered")
	proxy.waitAnswers(t, n.bed.Client, fAddr, "the flagged service never answered")

	t.Run("annotation_closes_at_the_deadline_with_a_FIN", func(t *testing.T) {
		kc := dialPod(t, n.bed.Client, dAddr, "pod1", 6)
		if err := kc.echo("before"); err != nil {
			t.Fatalf("echo before: %v", err)
		}
		left := time.Now()
		n.setPods(t, drained, map[int]podState{1: podTerminating, 2: podReady})
		onlyFrom(t, n, dAddr, "pod2")
		// Before the deadline the pod still serves its connection: no reset.
		waitUntil(t, left.Add(drain/2))
		if err := kc.echo("during"); err != nil {
			t.Fatalf("echo %v after pod1 turned terminating (deadline %v): %v, want it served", time.Since(left).Round(time.Millisecond), drain, err)
		}
		err := kc.readEnd(drain + 10*time.Second)
		took := time.Since(left)
		if err != io.EOF {
			t.Fatalf("connection ended with %v after %v, want EOF (FIN at the deadline)", err, took.Round(time.Millisecond))
		}
		// The proxy saw the change after left and before onlyFrom returned.
		if took < drain-500*time.Millisecond {
			t.Errorf("connection closed %v after pod1 turned terminating, before its drain-timeout %v", took.Round(time.Millisecond), drain)
		}
		kc.c.Close()
		want := drained.Namespace + "/web-1"
		eventually(t, 10*time.Second, "an access log line for the drained connection", func() error {
			for _, l := range accessLines(t, proxy, drained.Namespace+"/drained:http") {
				if l["reason"] == "drain-timeout" {
					if l["pod"] != want || l["node"] != n.name || l["endpoint"] != testbed.PodIP(1).String()+":8080" {
						return fmt.Errorf("line %v, want pod %s node %s", l, want, n.name)
					}
					return nil
				}
			}
			return errors.New("no line with reason drain-timeout")
		})
		if v, err := scrape(n.bed.Node, `kube_portal_proxy_drain_closed_total{protocol="tcp",service_port="`+drained.Namespace+`/drained:http"}`); err != nil || v != 1 {
			t.Errorf("drain_closed_total = %v (%v), want 1", v, err)
		}
	})

	t.Run("flag_keeps_a_serving_pod_and_resets_on_removal", func(t *testing.T) {
		kc := dialPod(t, n.bed.Client, fAddr, "pod1", 6)
		left := time.Now()
		n.setPods(t, flagged, map[int]podState{1: podTerminating, 2: podReady})
		onlyFrom(t, n, fAddr, "pod2")
		waitUntil(t, left.Add(drain))
		if err := kc.echo("still serving"); err != nil {
			t.Fatalf("echo to a terminating but serving pod under --drain-removed-endpoints: %v, want it kept", err)
		}
		n.setPods(t, flagged, map[int]podState{2: podReady}) // pod1 is gone
		err := kc.readEnd(10 * time.Second)
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("connection to the removed pod ended with %v, want a reset (--drain-removed-endpoints)", err)
		}
	})
}

// TestInvalidAnnotationWarns: a value that does not parse gives a Warning event InvalidAnnotation
// on the Service and the default, and the Service keeps serving.
func TestInvalidAnnotationWarns(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	svc := n.annotatedService(t, "typo", map[string]string{
		"portal-proxy.kubernetes.io/drain-timeout": "a minute", "portal-proxy.kubernetes.io/algorithm": "fastest"})
	n.setPods(t, svc, map[int]podState{1: podReady, 2: podReady})
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterTCP
	proxy.waitAnswers(t, n.bed.Client, addr, "the service with bad annotations never answered")
	if got := tally(t, whoTCP, n.bed.Client, addr, 4); got["pod1"] != 2 || got["pod2"] != 2 {
		t.Errorf("answers %v, want round robin (the default algorithm) over pod1 and pod2", got)
	}
	eventually(t, 30*time.Second, "Warning events for both annotations", func() error {
		evs, err := n.admin.CoreV1().Events(svc.Namespace).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			return err
		}
		var msgs []string
		for _, e := range evs.Items {
			if e.InvolvedObject.Kind == "Service" && e.InvolvedObject.Name == "typo" && e.Type == corev1.EventTypeWarning && e.Reason == "InvalidAnnotation" {
				msgs = append(msgs, e.Message)
			}
		}
		all := strings.Join(msgs, "\n")
		if !strings.Contains(all, `drain-timeout="a minute"`) || !strings.Contains(all, `algorithm="fastest"`) {
			return fmt.Errorf("InvalidAnnotation messages %q, want both bad values named", msgs)
		}
		return nil
	})
}

// TestAlgorithmAnnotation: with least-connections or random-two-choices, short connections go to
// the pod with fewer live ones: three long connections are held on pod1 (the only pod when they
// opened), then pod2 joins and gets every new short connection, where round robin would send
// half of them to pod1.
func TestAlgorithmAnnotation(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	algos := []string{"least-connections", "random-two-choices"}
	svcs := map[string]*corev1.Service{}
	for _, a := range algos {
		svcs[a] = n.annotatedService(t, a, map[string]string{"portal-proxy.kubernetes.io/algorithm": a})
		n.setPods(t, svcs[a], map[int]podState{1: podReady})
	}
	proxy := n.startProxy(t)
	for _, a := range algos {
		t.Run(a, func(t *testing.T) {
			svc := svcs[a]
			addr := targetsOf(t, svc).clusterTCP
			proxy.waitAnswers(t, n.bed.Client, addr, a+" service never answered")
			for range 3 {
				dialPod(t, n.bed.Client, addr, "pod1", 1)
			}
			n.setPods(t, svc, map[int]podState{1: podReady, 2: podReady})
			eventually(t, 30*time.Second, "pod2 in the rotation", func() error {
				if who, err := whoTCP(n.bed.Client, addr); err != nil || who != "pod2" {
					return fmt.Errorf("answered by %q, %v", who, err)
				}
				return nil
			})
			if got := tally(t, whoTCP, n.bed.Client, addr, 8); got["pod2"] != 8 {
				t.Errorf("short connections with 3 long ones on pod1: %v, want all 8 on pod2 (fewer live connections)", got)
			}
		})
	}
}

// TestOutlierAnnotation: a pod that black-holes new connections (its namespace drops SYNs) is
// ejected after outlier-consecutive-failures failed dials, so requests stop paying the 250 ms
// dial timeout; an EndpointEjected event names it; once it answers again it returns after the
// ejection time.
func TestOutlierAnnotation(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 3)
	svc := n.annotatedService(t, "outlier", map[string]string{
		"portal-proxy.kubernetes.io/outlier-consecutive-failures": "2",
		"portal-proxy.kubernetes.io/outlier-ejection-time":        "2s",
		"portal-proxy.kubernetes.io/outlier-max-ejection-percent": "50"})
	n.setPods(t, svc, map[int]podState{1: podReady, 2: podReady, 3: podReady})
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterTCP
	proxy.waitAnswers(t, n.bed.Client, addr, "the outlier service never answered")

	pod3 := n.bed.Pods[2].NS
	drop := []string{"iptables", "-w", "-I", "INPUT", "-p", "tcp", "--dport", "8080", "--syn", "-j", "DROP"}
	pod3.MustExec(t, drop...)
	// Requests still succeed (the dial to pod3 times out and fails over), slowly, until pod3 has
	// failed twice.
	timed := func(k int) (slow int, who map[string]int) {
		who = map[string]int{}
		for range k {
			start := time.Now()
			w, err := whoTCP(n.bed.Client, addr)
			if err != nil {
				t.Fatalf("request while pod3 black-holes: %v", err)
			}
			who[w]++
			if time.Since(start) >= 200*time.Millisecond {
				slow++
			}
		}
		return slow, who
	}
	slowBefore, _ := timed(9)
	if slowBefore < 2 {
		t.Errorf("%d of 9 requests paid the dial timeout before the ejection, want at least 2", slowBefore)
	}
	slowAfter, who := timed(9)
	if slowAfter != 0 || who["pod3"] != 0 {
		t.Errorf("after the ejection: %d of 9 requests slow, answers %v, want none slow and none from pod3", slowAfter, who)
	}
	eventually(t, 30*time.Second, "an EndpointEjected event naming pod3", func() error {
		evs, err := n.admin.CoreV1().Events(svc.Namespace).List(t.Context(), metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, e := range evs.Items {
			if e.Reason == "EndpointEjected" && e.InvolvedObject.Name == "outlier" && strings.Contains(e.Message, testbed.PodIP(3).String()) {
				return nil
			}
		}
		return errors.New("none yet")
	})
	pod3.MustExec(t, append([]string{"iptables", "-w", "-D"}, drop[3:]...)...)
	eventually(t, 30*time.Second, "pod3 back in the rotation after its ejection time", func() error {
		if got := tally(t, whoTCP, n.bed.Client, addr, 3); got["pod3"] == 0 {
			return fmt.Errorf("answers %v", got)
		}
		return nil
	})
}

// TestSlowStartAnnotation: a pod that joins a slow-start Service gets a small share of new
// connections at first, growing over the window; /debug/services shows its warming percent rise.
func TestSlowStartAnnotation(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	svc := n.annotatedService(t, "slow", map[string]string{"portal-proxy.kubernetes.io/slow-start": "10s"})
	n.setPods(t, svc, map[int]podState{1: podReady})
	proxy := n.startProxy(t)
	addr := targetsOf(t, svc).clusterTCP
	proxy.waitAnswers(t, n.bed.Client, addr, "the slow-start service never answered")
	n.setPods(t, svc, map[int]podState{1: podReady, 2: podReady})
	warming := func() int {
		var views []struct {
			Name      string `json:"name"`
			Endpoints []struct {
				Address        string `json:"address"`
				WarmingPercent int    `json:"warmingPercent"`
			} `json:"endpoints"`
		}
		w := -1
		eventually(t, 10*time.Second, "pod2 in /debug/services", func() error {
			code, body, err := httpGet(n.bed.Node, "http://"+metricsAddr+"/debug/services?format=json")
			if err != nil || code != 200 {
				return fmt.Errorf("GET /debug/services: %d %v", code, err)
			}
			if err := json.Unmarshal([]byte(body), &views); err != nil {
				return err
			}
			for _, v := range views {
				for _, e := range v.Endpoints {
					if v.Name == svc.Namespace+"/slow:http" && e.Address == testbed.PodIP(2).String()+":8080" {
						w = e.WarmingPercent
						return nil
					}
				}
			}
			return errors.New("not listed yet")
		})
		return w
	}
	eventually(t, 30*time.Second, "pod2 warming", func() error {
		if w := warming(); w <= 0 {
			return fmt.Errorf("warming %d%%", w)
		}
		return nil
	})
	first := warming()
	got := tally(t, whoTCP, n.bed.Client, addr, 20)
	if got["pod2"] >= 8 {
		t.Errorf("answers right after pod2 joined: %v, want pod2 well under half (warming %d%%)", got, first)
	}
	waitUntil(t, time.Now().Add(3*time.Second))
	if later := warming(); later <= first || later >= 100 {
		t.Errorf("warming percent %d%% then %d%% 3s later, want it rising within the 10s window", first, later)
	}
}
