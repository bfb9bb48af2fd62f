package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

// The live flow stream (/debug/flows and `kube-portal-proxy observe`) against the real binary and
// API server. Address plan: internal/testbed (pods 10.244.<i>.10 greet on TCP 8080 with
// "pod<i>\n" then echo, and answer UDP 5353 with "pod<i> <datagram>"; the client pod
// 172.30.0.2 and the external host 192.0.2.2 reach the node 192.0.2.1). Every slice names its
// pods <namespace>/web-<i> on the test's node (setPods), so the stream can name them.

// ovWait bounds the wait for a flow to show in the stream: its event is recorded when it
// happens, so this only covers the proxy seeing an API change and the test's own actions.
const ovWait = 30 * time.Second

// ovParse reads an NDJSON body of observe.Items and returns the flows in it.
func ovParse(body string) ([]observe.Flow, error) {
	var out []observe.Flow
	for line := range strings.SplitSeq(body, "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		var it observe.Item
		if err := json.Unmarshal([]byte(line), &it); err != nil {
			return nil, fmt.Errorf("stream line %q: %w", line, err)
		}
		if it.Flow != nil {
			out = append(out, *it.Flow)
		}
	}
	return out, nil
}

// ovGet fetches /debug/flows with q inside the node namespace and returns its flows.
func ovGet(n *clusterNode, q url.Values) ([]observe.Flow, error) {
	code, body, err := httpGet(n.bed.Node, "http://"+metricsAddr+"/debug/flows?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("GET /debug/flows?%s: %w", q.Encode(), err)
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("GET /debug/flows?%s: %d %s", q.Encode(), code, body)
	}
	return ovParse(body)
}

// ovCLI runs `kube-portal-proxy observe -o json` against the node's proxy, inside its namespace,
// and returns the flows it printed.
func ovCLI(n *clusterNode, args ...string) ([]observe.Flow, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	argv := append([]string{"netns", "exec", n.bed.Node.Name, proxyBinary, "observe", "-o", "json", "--address", metricsAddr}, args...)
	cmd := exec.CommandContext(ctx, "ip", argv...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("observe %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return ovParse(string(out))
}

// ovQuery is a /debug/flows query: pairs of key and value.
func ovQuery(kv ...string) url.Values {
	q := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		q.Add(kv[i], kv[i+1])
	}
	return q
}

// ovBrief is one line per flow, for failure messages.
func ovBrief(fs []observe.Flow) string {
	var b strings.Builder
	for _, f := range fs {
		fmt.Fprintf(&b, "\n  #%d %s/%s %s %s %s %s client=%s ep=%s end=%s dials=%d bytes=%d/%d",
			f.ID, f.Namespace, f.Service, f.Protocol, f.Path, f.Phase, f.Verdict, f.Client, f.Endpoint, f.EndReason,
			f.DialAttempts, f.BytesToEndpoint, f.BytesToClient)
	}
	return b.String()
}

// ovFind waits until fetch returns a flow that check accepts (nil error), and returns it. On
// timeout it fails t with what, check's complaint about the last candidate and the flows seen.
func ovFind(t *testing.T, what string, fetch func() ([]observe.Flow, error), check func(*observe.Flow) error) observe.Flow {
	t.Helper()
	var found observe.Flow
	eventually(t, ovWait, what, func() error {
		fs, err := fetch()
		if err != nil {
			return err
		}
		var last error = errors.New("no flow at all")
		for i := range fs {
			if err := check(&fs[i]); err != nil {
				last = err
				continue
			}
			found = fs[i]
			return nil
		}
		return fmt.Errorf("%v; flows:%s", last, ovBrief(fs))
	})
	return found
}

// ovWant is what a flow event must show; empty fields are not checked.
type ovWant struct {
	phase, verdict, endReason string
	protocol, path            string
	client                    string // ip:port, or an IP: the client's address must be that one
	serviceAddr               string
	endpoint                  string // ip:port; "-" for none
	pod                       string // endpoint_pod
	node                      string // endpoint_node
	dials                     int    // dial_attempts; 0: not checked, -1: at least one
	toEndpoint, toClient      int64  // bytes each way; 0: not checked, -1: at least one
	algorithm                 string
}

// ovMatch checks f against w and the namespace and service.
func ovMatch(ns, svc string, w ovWant) func(*observe.Flow) error {
	return func(f *observe.Flow) error {
		var bad []string
		eq := func(field, got, want string) {
			if want != "" && got != want {
				bad = append(bad, fmt.Sprintf("%s %q, want %q", field, got, want))
			}
		}
		eq("namespace", f.Namespace, ns)
		eq("service", f.Service, svc)
		eq("phase", f.Phase, w.phase)
		eq("verdict", f.Verdict, w.verdict)
		eq("end_reason", f.EndReason, w.endReason)
		eq("protocol", f.Protocol, w.protocol)
		eq("path", f.Path, w.path)
		eq("service_address", f.ServiceAddress, w.serviceAddr)
		eq("endpoint_pod", f.EndpointPod, w.pod)
		eq("endpoint_node", f.EndpointNode, w.node)
		if w.client != "" {
			if strings.Contains(w.client, ":") {
				eq("client", f.Client, w.client)
			} else if ap, err := netip.ParseAddrPort(f.Client); err != nil || ap.Addr().String() != w.client {
				bad = append(bad, fmt.Sprintf("client %q, want one of %s", f.Client, w.client))
			}
		}
		switch w.endpoint {
		case "":
		case "-":
			eq("endpoint", f.Endpoint, "")
		default:
			eq("endpoint", f.Endpoint, w.endpoint)
		}
		num := func(field string, got, want int64) {
			if (want > 0 && got != want) || (want < 0 && got <= 0) {
				bad = append(bad, fmt.Sprintf("%s %d, want %d (-1: some)", field, got, want))
			}
		}
		num("dial_attempts", int64(f.DialAttempts), int64(w.dials))
		num("bytes_to_endpoint", int64(f.BytesToEndpoint), w.toEndpoint)
		num("bytes_to_client", int64(f.BytesToClient), w.toClient)
		if w.algorithm != "" && (f.Pick == nil || f.Pick.Algorithm != w.algorithm) {
			bad = append(bad, fmt.Sprintf("pick %+v, want algorithm %s", f.Pick, w.algorithm))
		}
		if len(bad) > 0 {
			return fmt.Errorf("flow #%d %s %s: %s", f.ID, f.Phase, f.Verdict, strings.Join(bad, "; "))
		}
		return nil
	}
}

// ovFlowsOf fetches one Service's flows (every phase) from the raw endpoint.
func ovFlowsOf(n *clusterNode, svc *corev1.Service, kv ...string) func() ([]observe.Flow, error) {
	return func() ([]observe.Flow, error) {
		return ovGet(n, ovQuery(append([]string{"service", svc.Namespace + "/" + svc.Name}, kv...)...))
	}
}

// ovCLIOf fetches one Service's flows of every phase through the observe command.
func ovCLIOf(n *clusterNode, svc *corev1.Service, args ...string) func() ([]observe.Flow, error) {
	return func() ([]observe.Flow, error) {
		return ovCLI(n, append([]string{"--service", svc.Namespace + "/" + svc.Name, "--phase", "all"}, args...)...)
	}
}

// ovPhases returns the phases of flow id in fs, in stream order.
func ovPhases(fs []observe.Flow, id uint64) []string {
	var out []string
	for _, f := range fs {
		if f.ID == id {
			out = append(out, f.Phase)
		}
	}
	return out
}

// ovPinger keeps a UDP session alive: a datagram every 200 ms on c until stop, the answers
// read and dropped. stop waits for its goroutines and closes c.
func ovPinger(c net.Conn) (stop func()) {
	done := make(chan struct{})
	_ = c.SetDeadline(time.Time{}) // an earlier exchange's deadline would fail every read and write
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, 512)
		for {
			if _, err := c.Read(buf); err != nil && errors.Is(err, net.ErrClosed) {
				return
			}
		}
	})
	wg.Go(func() {
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			_, _ = c.Write([]byte("ping"))
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			close(done)
			c.Close()
			wg.Wait()
		})
	}
}

// ovUDP opens a connected UDP socket from ns to addr.
func ovUDP(t *testing.T, ns *netns.NS, addr netip.AddrPort) net.Conn {
	t.Helper()
	var c net.Conn
	if err := ns.Do(func() (err error) {
		c, err = net.Dial("udp", addr.String())
		return err
	}); err != nil {
		t.Fatalf("UDP socket in %s: %v", ns.Name, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// ovSpec is a ClusterIP Service's spec with one TCP and one UDP port to the pods' given ports.
func ovSpec(tcpTarget, udpTarget int32) corev1.ServiceSpec {
	return corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, Ports: []corev1.ServicePort{
		{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(tcpTarget)},
		{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(udpTarget)},
	}}
}

// ovEndpoint is pod i's address on port, and its name as the slices give it.
func ovEndpoint(ns string, i int, port uint16) (ep, pod string) {
	return netip.AddrPortFrom(testbed.PodIP(i), port).String(), fmt.Sprintf("%s/web-%d", ns, i)
}

// TestFlowStreamVerdicts provokes every verdict the proxy socket and the kernel path can reach
// from outside, on both io engines, and finds each in /debug/flows (or through `observe -o
// json`) with its Service, protocol, client, endpoint with pod and node, end reason, dial
// attempts and bytes.
func TestFlowStreamVerdicts(t *testing.T) {
	t.Parallel()
	for _, engine := range []string{tcp.EngineIOUring, tcp.EngineEpoll} {
		t.Run(engine, func(t *testing.T) {
			t.Parallel()
			if engine == tcp.EngineIOUring {
				if err := tcp.ProbeIOUring(); err != nil {
					testenv.Unavailable(t, "io_uring unavailable: %v", err)
				}
			}
			ovVerdicts(t, engine)
		})
	}
}

// ovVerdicts runs the verdict scenarios on one engine: one node and proxy for the portal
// (iptables) mode, and a second in bind mode for the source ranges, which only bind mode checks
// on the socket (iptables mode drops a denied client in its rules, before the proxy sees it).
func ovVerdicts(t *testing.T, engine string) {
	const (
		idle    = 5 * time.Second // --tcp-idle-timeout
		udpIdle = 2 * time.Second // --udp-timeout
	)
	n := newClusterNode(t, 3)
	ns := n.namespace
	ready := func(pods ...int) map[int]podState {
		m := map[int]podState{}
		for _, p := range pods {
			m[p] = podReady
		}
		return m
	}
	tcpOnly := corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, Ports: []corev1.ServicePort{
		{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080)}}}
	fwd := n.createAnnotated(t, "fwd", map[string]string{proxier.AnnotationAlgorithm: "round-robin"}, ovSpec(8080, 5353))
	n.setPods(t, fwd, ready(1, 2))
	closedPort := n.createService(t, "closedport", ovSpec(9, 9)) // nothing listens on 9 in the pods
	n.setPods(t, closedPort, ready(1))
	rst := n.createService(t, "rst", tcpOnly)
	n.setPods(t, rst, ready(1))
	idled := n.createService(t, "idle", tcpOnly)
	n.setPods(t, idled, ready(1))
	held := n.createAnnotated(t, "held", map[string]string{proxier.AnnotationHoldTimeout: "2s"}, tcpOnly)
	refuse := n.createAnnotated(t, "refuse", map[string]string{proxier.AnnotationHoldTimeout: "1m"}, tcpOnly)
	eject := n.createService(t, "eject", ovSpec(8080, 5353))
	n.setPods(t, eject, ready(1))
	drain := n.createAnnotated(t, "drain", map[string]string{proxier.AnnotationDrainTimeout: "1s"}, tcpOnly)
	n.setPods(t, drain, ready(1, 2))
	evict := n.createService(t, "evict", ovSpec(8080, 5353))
	n.setPods(t, evict, ready(1))
	gone := n.createService(t, "gone", ovSpec(8080, 5353))
	n.setPods(t, gone, ready(1))
	kern := n.createAnnotated(t, "kern", map[string]string{annotationDataPath: "kernel"}, tcpOnly)
	n.setPods(t, kern, ready(1))

	proxy := n.startProxy(t, "--io-engine="+engine, "--drain-removed-endpoints",
		"--tcp-idle-timeout="+idle.String(), "--udp-timeout="+udpIdle.String(), "--udp-max-sessions=3")
	for _, s := range []*corev1.Service{fwd, rst, idled, eject, drain, gone} {
		proxy.waitAnswers(t, n.bed.Client, targetsOf(t, s).clusterTCP, "service "+s.Name+" never answered")
	}
	if v, err := scrape(n.bed.Node, fmt.Sprintf("kube_portal_proxy_io_engine{engine=%q}", engine)); err != nil || v != 1 {
		t.Fatalf("the proxy does not serve on %s: io_engine gauge %v, %v", engine, v, err)
	}
	pod1ep, pod1 := ovEndpoint(ns, 1, 8080)
	pod1udp, _ := ovEndpoint(ns, 1, 5353)
	client := testbed.ClientIP.String()

	t.Run("tcp_forwarded", func(t *testing.T) {
		t.Parallel()
		addr := targetsOf(t, fwd).clusterTCP
		c, err := dialTCP(n.bed.Client, addr)
		if err != nil {
			t.Fatal(err)
		}
		local := c.LocalAddr().String()
		_ = c.SetDeadline(time.Now().Add(requestTimeout))
		r := bufio.NewReader(c)
		greeting, err := r.ReadString('\n')
		if err == nil {
			_, err = io.WriteString(c, "hello\n")
		}
		if err == nil {
			_, err = r.ReadString('\n')
		}
		c.Close()
		if err != nil {
			t.Fatalf("request through %s: %v", addr, err)
		}
		i := int(greeting[3] - '0') // "podN\n"
		ep, pod := ovEndpoint(ns, i, 8080)
		// Through the CLI: the same items the endpoint serves.
		end := ovFind(t, "the forwarded connection's end (observe -o json)", ovCLIOf(n, fwd, "--client", client+"/32"),
			ovMatch(ns, "fwd", ovWant{phase: "end", verdict: "forwarded", endReason: "client-closed", protocol: "TCP", path: "socket",
				client: local, serviceAddr: addr.String(), endpoint: ep, pod: pod, node: n.name, dials: 1,
				toEndpoint: 6, toClient: int64(len(greeting)) + 6, algorithm: "round-robin"}))
		if end.Node != n.name || end.Port != "http" {
			t.Errorf("end event node %q port %q, want %q and http", end.Node, end.Port, n.name)
		}
		all, err := ovCLI(n, "--service", ns+"/fwd", "--phase", "all")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := ovPhases(all, end.ID), []string{"start", "dial", "first-byte", "end"}; !slices.Equal(got, want) {
			t.Errorf("phases of flow #%d: %v, want %v:%s", end.ID, got, want, ovBrief(all))
		}
		for _, f := range all {
			if f.ID == end.ID && f.Phase != "end" && (f.Verdict != "forwarded" || f.Endpoint != ep || f.Client != local) {
				t.Errorf("live event %s of flow #%d: verdict %s endpoint %s client %s", f.Phase, f.ID, f.Verdict, f.Endpoint, f.Client)
			}
		}
	})

	t.Run("udp_forwarded", func(t *testing.T) {
		t.Parallel()
		c := ovUDP(t, n.bed.Client, targetsOf(t, fwd).clusterUDP)
		who, err := testbed.Ask(c, "query", requestTimeout)
		if err != nil {
			t.Fatal(err)
		}
		i := int(who[3] - '0')
		ep, pod := ovEndpoint(ns, i, 5353)
		// A UDP session's normal end is its idle timeout: forwarded, not timeout.
		end := ovFind(t, "the UDP session's end after --udp-timeout", ovFlowsOf(n, fwd, "protocol", "udp"),
			ovMatch(ns, "fwd", ovWant{phase: "end", verdict: "forwarded", endReason: "idle-timeout", protocol: "UDP", path: "socket",
				client: c.LocalAddr().String(), endpoint: ep, pod: pod, node: n.name,
				toEndpoint: int64(len("query")), toClient: int64(len(who) + 1 + len("query"))}))
		all, err := ovGet(n, ovQuery("service", ns+"/fwd", "protocol", "udp"))
		if err != nil {
			t.Fatal(err)
		}
		if got := ovPhases(all, end.ID); !slices.Equal(got, []string{"start", "end"}) {
			t.Errorf("phases of UDP flow #%d: %v, want [start end]", end.ID, got)
		}
	})

	t.Run("dial_failed_and_unreachable", func(t *testing.T) {
		t.Parallel()
		tg := targetsOf(t, closedPort)
		if _, err := whoTCP(n.bed.Client, tg.clusterTCP); err == nil {
			t.Fatalf("TCP to an endpoint port nobody listens on was answered")
		}
		ep9, _ := ovEndpoint(ns, 1, 9)
		ovFind(t, "dial-failed", ovFlowsOf(n, closedPort, "verdict", "dial-failed"),
			ovMatch(ns, "closedport", ovWant{phase: "end", verdict: "dial-failed", endReason: "dial-failed", protocol: "TCP",
				client: client, endpoint: ep9, pod: pod1, node: n.name, dials: -1}))
		c := ovUDP(t, n.bed.Client, tg.clusterUDP)
		_, _ = c.Write([]byte("who"))
		ovFind(t, "unreachable", ovFlowsOf(n, closedPort, "protocol", "udp", "phase", "end"),
			ovMatch(ns, "closedport", ovWant{phase: "end", verdict: "unreachable", endReason: "endpoint-refused", protocol: "UDP",
				client: c.LocalAddr().String(), endpoint: ep9, pod: pod1, node: n.name, toEndpoint: 3}))
	})

	t.Run("reset", func(t *testing.T) {
		t.Parallel()
		c, err := dialTCP(n.bed.Client, targetsOf(t, rst).clusterTCP)
		if err != nil {
			t.Fatal(err)
		}
		local := c.LocalAddr().String()
		_ = c.SetDeadline(time.Now().Add(requestTimeout))
		if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		_ = c.(*net.TCPConn).SetLinger(0) // close with a reset
		c.Close()
		ovFind(t, "reset", ovFlowsOf(n, rst, "phase", "end"),
			ovMatch(ns, "rst", ovWant{verdict: "reset", endReason: "client-reset", protocol: "TCP", client: local,
				endpoint: pod1ep, pod: pod1, node: n.name, dials: 1, toClient: int64(len("pod1\n"))}))
	})

	t.Run("timeout", func(t *testing.T) {
		t.Parallel()
		c, err := dialTCP(n.bed.Client, targetsOf(t, idled).clusterTCP)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		local := c.LocalAddr().String()
		_ = c.SetDeadline(time.Now().Add(idle*2 + 10*time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil { // the greeting, then the proxy's close
			t.Logf("idle connection ended with %v", err)
		}
		ovFind(t, "timeout", ovFlowsOf(n, idled, "phase", "end"),
			ovMatch(ns, "idle", ovWant{verdict: "timeout", endReason: "idle-timeout", protocol: "TCP", client: local,
				endpoint: pod1ep, pod: pod1, node: n.name, dials: 1, toClient: int64(len("pod1\n"))}))
	})

	t.Run("held", func(t *testing.T) {
		t.Parallel()
		c, err := dialTCP(n.bed.Client, targetsOf(t, held).clusterTCP)
		if err != nil {
			t.Fatalf("connect to the held service: %v, want it accepted", err)
		}
		defer c.Close()
		local := c.LocalAddr().String()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		_, _ = io.Copy(io.Discard, c) // reset at the 2 s hold timeout
		fetch := ovCLIOf(n, held, "--verdict", "held")
		ovFind(t, "the held event", fetch, ovMatch(ns, "held", ovWant{phase: "held", verdict: "held", protocol: "TCP", client: local, endpoint: "-"}))
		ovFind(t, "the held end", fetch, ovMatch(ns, "held", ovWant{phase: "end", verdict: "held", endReason: "hold-timeout", client: local, endpoint: "-"}))
	})

	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		// The portal rules reject a port without endpoints before the proxy sees it, unless the
		// port holds: a held connection whose Service is deleted gets one last pick, finds no
		// endpoint and is reset, refused for no endpoints.
		c, err := dialTCP(n.bed.Client, targetsOf(t, refuse).clusterTCP)
		if err != nil {
			t.Fatalf("connect to the held service: %v, want it accepted", err)
		}
		defer c.Close()
		local := c.LocalAddr().String()
		ovFind(t, "the held event", ovFlowsOf(n, refuse, "phase", "held"),
			ovMatch(ns, "refuse", ovWant{verdict: "held", client: local}))
		if err := n.admin.CoreV1().Services(ns).Delete(t.Context(), "refuse", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		ovFind(t, "refused once the Service is gone", ovFlowsOf(n, refuse, "phase", "end"),
			ovMatch(ns, "refuse", ovWant{verdict: "refused", endReason: "no-endpoints", protocol: "TCP", client: local, endpoint: "-"}))
	})

	t.Run("ejected", func(t *testing.T) {
		t.Parallel()
		tg := targetsOf(t, eject)
		kc := dialPod(t, n.bed.Client, tg.clusterTCP, "pod1", 1)
		local := kc.c.LocalAddr().String()
		u := ovUDP(t, n.bed.Client, tg.clusterUDP)
		if who, err := testbed.Ask(u, "who", requestTimeout); err != nil || who != "pod1" {
			t.Fatalf("UDP to the eject service: %q, %v", who, err)
		}
		stop := ovPinger(u) // the session stays live past --udp-timeout
		defer stop()
		if err := kc.echo("before"); err != nil {
			t.Fatal(err)
		}
		n.setPods(t, eject, ready(2)) // pod1 leaves the Service
		ovFind(t, "TCP ejected", ovFlowsOf(n, eject, "phase", "end", "protocol", "tcp"),
			ovMatch(ns, "eject", ovWant{verdict: "ejected", endReason: "endpoint-removed", client: local,
				endpoint: pod1ep, pod: pod1, node: n.name, dials: 1, toEndpoint: int64(len("before\n"))}))
		ovFind(t, "UDP ejected", ovFlowsOf(n, eject, "phase", "end", "protocol", "udp"),
			ovMatch(ns, "eject", ovWant{verdict: "ejected", endReason: "endpoint-removed", client: u.LocalAddr().String(),
				endpoint: pod1udp, pod: pod1, node: n.name, toEndpoint: -1, toClient: -1}))
	})

	t.Run("drained", func(t *testing.T) {
		t.Parallel()
		kc := dialPod(t, n.bed.Client, targetsOf(t, drain).clusterTCP, "pod1", 6)
		local := kc.c.LocalAddr().String()
		n.setPods(t, drain, map[int]podState{1: podTerminating, 2: podReady})
		if err := kc.readEnd(15 * time.Second); err != io.EOF {
			t.Errorf("drained connection ended with %v, want EOF (a FIN at the drain deadline)", err)
		}
		ovFind(t, "drained", ovFlowsOf(n, drain, "phase", "end", "client", client),
			ovMatch(ns, "drain", ovWant{verdict: "drained", endReason: "drain-timeout", protocol: "TCP", client: local,
				endpoint: pod1ep, pod: pod1, node: n.name, dials: 1}))
	})

	t.Run("evicted", func(t *testing.T) {
		t.Parallel()
		// --udp-max-sessions=3: a fourth client's session evicts the least recently used.
		var first string
		for i := range 4 {
			c := ovUDP(t, n.bed.Client, targetsOf(t, evict).clusterUDP)
			if _, err := testbed.Ask(c, "who", requestTimeout); err != nil {
				t.Fatalf("query %d: %v", i, err)
			}
			if i == 0 {
				first = c.LocalAddr().String()
			}
		}
		ovFind(t, "evicted", ovFlowsOf(n, evict, "verdict", "evicted"),
			ovMatch(ns, "evict", ovWant{phase: "end", endReason: "evicted", protocol: "UDP", client: first,
				endpoint: pod1udp, pod: pod1, node: n.name, toEndpoint: 3, toClient: -1}))
	})

	t.Run("closed", func(t *testing.T) {
		t.Parallel()
		u := ovUDP(t, n.bed.Client, targetsOf(t, gone).clusterUDP)
		if _, err := testbed.Ask(u, "who", requestTimeout); err != nil {
			t.Fatal(err)
		}
		stop := ovPinger(u)
		defer stop()
		if err := n.admin.CoreV1().Services(ns).Delete(t.Context(), "gone", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		ovFind(t, "closed with its proxy socket", ovFlowsOf(n, gone, "phase", "end", "protocol", "udp"),
			// The balancer named the pod at the pick: still named after its Service is gone.
			ovMatch(ns, "gone", ovWant{verdict: "closed", endReason: "shutdown", client: u.LocalAddr().String(),
				endpoint: pod1udp, pod: pod1, node: n.name, toEndpoint: -1}))
	})

	t.Run("kernel", func(t *testing.T) {
		t.Parallel()
		name := ns + "/kern:http"
		eventually(t, ovWait, "the kern Service on the kernel path", func() error {
			v, err := debugViewOf(n, name)
			if err != nil {
				return err
			}
			if v.DataPath != "kernel" {
				return fmt.Errorf("%s on path %q", name, v.DataPath)
			}
			return nil
		})
		// Counters need nf_conntrack_acct when the entry is made; a short TIME_WAIT makes the
		// entry's DESTROY (the flow's end) come within the test. Per network namespace.
		n.bed.Node.MustExec(t, "sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1", "net.netfilter.nf_conntrack_timestamp=1",
			"net.netfilter.nf_conntrack_tcp_timeout_time_wait=1", "net.netfilter.nf_conntrack_tcp_timeout_close=1")
		addr := targetsOf(t, kern).clusterTCP
		c, err := dialTCP(n.bed.Client, addr)
		if err != nil {
			t.Fatal(err)
		}
		local := c.LocalAddr().String()
		_ = c.SetDeadline(time.Now().Add(requestTimeout))
		r := bufio.NewReader(c)
		if _, err = r.ReadString('\n'); err == nil {
			if _, err = io.WriteString(c, "hello\n"); err == nil {
				_, err = r.ReadString('\n')
			}
		}
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		want := ovWant{verdict: "kernel", protocol: "TCP", path: "kernel", client: local, serviceAddr: addr.String(),
			endpoint: pod1ep, pod: pod1, node: n.name}
		start := want
		start.phase = "start"
		ovFind(t, "the kernel flow's start", ovFlowsOf(n, kern, "path", "kernel"), ovMatch(ns, "kern", start))
		end := want
		end.phase, end.toEndpoint, end.toClient = "end", int64(len("hello\n")), int64(len("pod1\nhello\n"))
		ovFind(t, "the kernel flow's end (conntrack DESTROY)", ovFlowsOf(n, kern, "path", "kernel"), func(f *observe.Flow) error {
			if err := ovMatch(ns, "kern", ovWant{phase: "end", verdict: "kernel", path: "kernel", client: local, endpoint: pod1ep})(f); err != nil {
				return err
			}
			// conntrack counts whole packets, headers included: more than the payload.
			if f.BytesToEndpoint <= uint64(end.toEndpoint) || f.BytesToClient <= uint64(end.toClient) {
				return fmt.Errorf("flow #%d bytes %d/%d, want more than the payload %d/%d",
					f.ID, f.BytesToEndpoint, f.BytesToClient, end.toEndpoint, end.toClient)
			}
			return nil
		})
	})

	t.Run("source_denied", func(t *testing.T) {
		t.Parallel()
		ovSourceDenied(t, engine)
	})
}

// ovSourceDenied: in bind mode a LoadBalancer Service's socket on its load-balancer IP checks
// loadBalancerSourceRanges itself; the client pod (172.30.0.2) is outside 192.0.2.0/24, so its
// TCP connection is reset and its datagram dropped, each a source-denied flow without endpoint.
func ovSourceDenied(t *testing.T, engine string) {
	n := newClusterNode(t, 1)
	lbIP := externalIP()
	spec := ovSpec(8080, 5353)
	spec.Type = corev1.ServiceTypeLoadBalancer
	spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24"}
	svc := n.createService(t, "lb", spec)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbIP}}
	if _, err := n.admin.CoreV1().Services(n.namespace).UpdateStatus(t.Context(), svc, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("load-balancer status: %v", err)
	}
	n.setPods(t, svc, map[int]podState{1: podReady})
	proxy := n.startProxy(t, "--io-engine="+engine, "--portal-mode=bind", "--portal-interface=kpp-svc")
	lbTCP := netip.AddrPortFrom(netip.MustParseAddr(lbIP), 80)
	lbUDP := netip.AddrPortFrom(netip.MustParseAddr(lbIP), 53)
	proxy.waitAnswers(t, n.bed.External, lbTCP, "the load-balancer IP never answered the admitted client")

	// The kernel completes the handshake and the proxy resets the connection as it accepts it,
	// which the client may see already in its connect: hence its address, not its port.
	if who, err := whoTCP(n.bed.Client, lbTCP); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("denied client to %s: %q, %v; want the connection reset", lbTCP, who, err)
	}
	u := ovUDP(t, n.bed.Client, lbUDP)
	_, _ = u.Write([]byte("who"))
	fetch := ovFlowsOf(n, svc, "verdict", "source-denied")
	ovFind(t, "TCP source-denied", fetch, ovMatch(n.namespace, "lb", ovWant{phase: "end", endReason: "source-denied", protocol: "TCP",
		client: testbed.ClientIP.String(), serviceAddr: lbTCP.String(), endpoint: "-"}))
	ovFind(t, "UDP source-denied", fetch, ovMatch(n.namespace, "lb", ovWant{phase: "end", endReason: "source-denied", protocol: "UDP",
		client: u.LocalAddr().String(), endpoint: "-"}))
	// The admitted external host's flows are not denied.
	ovFind(t, "the admitted client forwarded", ovFlowsOf(n, svc, "client", testbed.ExternalIP.String(), "phase", "end"),
		ovMatch(n.namespace, "lb", ovWant{verdict: "forwarded", protocol: "TCP", endpoint: netip.AddrPortFrom(testbed.PodIP(1), 8080).String()}))
}

// ovRequest makes one request from ns to addr (the greeting, then close) and returns the
// client's address.
func ovRequest(t *testing.T, ns *netns.NS, addr netip.AddrPort) string {
	t.Helper()
	c, err := dialTCP(ns, addr)
	if err != nil {
		t.Fatalf("connect to %s from %s: %v", addr, ns.Name, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(requestTimeout))
	if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
		t.Fatalf("greeting from %s: %v", addr, err)
	}
	return c.LocalAddr().String()
}

// ovFollow streams the flows of r's lines on a goroutine until r ends or ctx is done; the channel
// closes then. The caller owns r and ends it (cancelling the request or killing the command).
func ovFollow(t *testing.T, ctx context.Context, r io.Reader) <-chan observe.Flow {
	ch := make(chan observe.Flow, 64)
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(ch)
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			fs, err := ovParse(sc.Text())
			if err != nil {
				t.Errorf("follow: %v", err)
				return
			}
			for _, f := range fs {
				select {
				case ch <- f:
				case <-ctx.Done():
					return
				}
			}
		}
	})
	t.Cleanup(wg.Wait)
	return ch
}

// ovNext waits (10 s) for a followed flow from client and fails t without one.
func ovNext(t *testing.T, ch <-chan observe.Flow, client, what string) observe.Flow {
	t.Helper()
	timeout := time.After(10 * time.Second)
	var seen []observe.Flow
	for {
		select {
		case f, ok := <-ch:
			if !ok {
				t.Fatalf("%s: the stream ended; it sent:%s", what, ovBrief(seen))
			}
			if f.Client == client {
				return f
			}
			seen = append(seen, f)
		case <-timeout:
			t.Fatalf("%s: no flow from %s within 10s; the stream sent:%s", what, client, ovBrief(seen))
		}
	}
}

// TestFlowStreamFilters checks last, since, the allow and deny filters and follow on the raw
// /debug/flows and through `kube-portal-proxy observe`, against one proxy's real flows: TCP
// requests to alpha (pod1) from the client pod and the external host, a UDP query and a reset
// to beta (pod2).
func TestFlowStreamFilters(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	ns := n.namespace
	alpha := n.createService(t, "alpha", ovSpec(8080, 5353))
	n.setPods(t, alpha, map[int]podState{1: podReady})
	beta := n.createService(t, "beta", ovSpec(8080, 5353))
	n.setPods(t, beta, map[int]podState{2: podReady})
	proxy := n.startProxy(t, "--udp-timeout=1s")
	a, b := targetsOf(t, alpha), targetsOf(t, beta)
	proxy.waitAnswers(t, n.bed.Client, a.clusterTCP, "alpha never answered")
	proxy.waitAnswers(t, n.bed.Client, b.clusterTCP, "beta never answered")
	// The waits' own connections are flows too: the checks start after them.
	eventually(t, ovWait, "the waits' flows ended", func() error {
		fs, err := ovGet(n, ovQuery("namespace", ns, "phase", "end"))
		if err != nil || len(fs) < 2 {
			return fmt.Errorf("%d end events, %v", len(fs), err)
		}
		return nil
	})
	since := time.Now()

	ovRequest(t, n.bed.Client, a.clusterTCP)
	ovRequest(t, n.bed.Client, a.clusterTCP)
	external := ovRequest(t, n.bed.External, a.clusterTCP)
	u := ovUDP(t, n.bed.Client, b.clusterUDP)
	if _, err := testbed.Ask(u, "who", requestTimeout); err != nil {
		t.Fatal(err)
	}
	rc, err := dialTCP(n.bed.Client, b.clusterTCP)
	if err != nil {
		t.Fatal(err)
	}
	_ = rc.SetDeadline(time.Now().Add(requestTimeout))
	if _, err := bufio.NewReader(rc).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	_ = rc.(*net.TCPConn).SetLinger(0)
	rc.Close()
	base := []string{"namespace", ns, "phase", "end", "since", since.Format(time.RFC3339Nano)}
	eventually(t, ovWait, "the five flows ended", func() error {
		fs, err := ovGet(n, ovQuery(base...))
		if err != nil || len(fs) != 5 {
			return fmt.Errorf("%d end events, %v:%s", len(fs), err, ovBrief(fs))
		}
		return nil
	})
	mid := time.Now()
	last := ovRequest(t, n.bed.Client, a.clusterTCP) // the sixth, after mid
	eventually(t, ovWait, "the sixth flow ended", func() error {
		fs, err := ovGet(n, ovQuery(base...))
		if err != nil || len(fs) != 6 {
			return fmt.Errorf("%d end events, %v", len(fs), err)
		}
		return nil
	})

	is := func(f *observe.Flow, svc, proto, verdict string) bool {
		return (svc == "" || f.Service == svc) && (proto == "" || f.Protocol == proto) && (verdict == "" || f.Verdict == verdict)
	}
	web1, web2 := ns+"/web-1", ns+"/web-2"
	for _, tt := range []struct {
		name  string
		query []string // added to base
		cli   []string // the observe flags for the same (after -n ns --since)
		want  int
		each  func(f *observe.Flow) bool
	}{
		{"service", []string{"service", ns + "/alpha"}, []string{"--service", ns + "/alpha"}, 4,
			func(f *observe.Flow) bool { return is(f, "alpha", "TCP", "forwarded") }},
		{"service_by_name", []string{"service", "beta"}, []string{"--service", "beta"}, 2,
			func(f *observe.Flow) bool { return f.Service == "beta" }},
		{"protocol", []string{"protocol", "udp"}, []string{"--protocol", "udp"}, 1,
			func(f *observe.Flow) bool {
				return is(f, "beta", "UDP", "forwarded") && f.Client == u.LocalAddr().String()
			}},
		{"not_protocol", []string{"not-protocol", "udp"}, []string{"--not-protocol", "udp"}, 5,
			func(f *observe.Flow) bool { return f.Protocol == "TCP" }},
		{"verdict", []string{"verdict", "reset"}, []string{"--verdict", "reset"}, 1,
			func(f *observe.Flow) bool { return is(f, "beta", "TCP", "reset") && f.EndReason == "client-reset" }},
		{"verdicts_or", []string{"verdict", "reset,refused"}, []string{"--verdict", "reset", "--verdict", "refused"}, 1,
			func(f *observe.Flow) bool { return f.Verdict == "reset" }},
		{"not_verdict", []string{"not-verdict", "forwarded"}, []string{"--not-verdict", "forwarded"}, 1,
			func(f *observe.Flow) bool { return f.Verdict == "reset" }},
		{"client_cidr", []string{"client", "192.0.2.0/24"}, []string{"--client", "192.0.2.0/24"}, 1,
			func(f *observe.Flow) bool { return f.Client == external }},
		{"not_client_ip", []string{"not-client", testbed.ClientIP.String()}, []string{"--not-client", testbed.ClientIP.String()}, 1,
			func(f *observe.Flow) bool { return f.Client == external }},
		{"pod_prefix", []string{"pod", ns + "/web-"}, []string{"--pod", ns + "/web-"}, 6,
			func(f *observe.Flow) bool { return f.EndpointPod == web1 || f.EndpointPod == web2 }},
		{"pod", []string{"pod", web2}, []string{"--pod", web2}, 2,
			func(f *observe.Flow) bool {
				return f.Service == "beta" && f.EndpointPod == web2 && f.EndpointNode == n.name
			}},
		{"not_pod_and_protocol", []string{"not-pod", web1, "protocol", "tcp"}, []string{"--not-pod", web1, "--protocol", "tcp"}, 1,
			func(f *observe.Flow) bool { return is(f, "beta", "TCP", "reset") }},
		{"keys_and", []string{"service", ns + "/alpha", "client", "192.0.2.2"}, []string{"--service", ns + "/alpha", "--client", "192.0.2.2"}, 1,
			func(f *observe.Flow) bool { return f.Client == external }},
		{"last", []string{"service", ns + "/alpha", "last", "1"}, []string{"--service", ns + "/alpha", "--last", "1"}, 1,
			func(f *observe.Flow) bool { return f.Client == last }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			check := func(via string, fs []observe.Flow, err error) {
				t.Helper()
				if err != nil {
					t.Fatalf("%s: %v", via, err)
				}
				bad := 0
				for i := range fs {
					if !tt.each(&fs[i]) || fs[i].Phase != "end" || fs[i].Namespace != ns {
						bad++
					}
				}
				if len(fs) != tt.want || bad > 0 {
					t.Errorf("%s: %d flows (%d unexpected), want %d:%s", via, len(fs), bad, tt.want, ovBrief(fs))
				}
			}
			fs, err := ovGet(n, ovQuery(append(slices.Clone(base), tt.query...)...))
			check("/debug/flows", fs, err)
			fs, err = ovCLI(n, append([]string{"-n", ns, "--since", since.Format(time.RFC3339Nano)}, tt.cli...)...)
			check("observe", fs, err)
		})
	}

	t.Run("since", func(t *testing.T) {
		// Every phase of the one flow after mid, and nothing before it.
		fs, err := ovGet(n, ovQuery("namespace", ns, "since", mid.Format(time.RFC3339Nano)))
		if err != nil {
			t.Fatal(err)
		}
		var phases []string
		for _, f := range fs {
			if f.Client != last || f.Time.Before(mid) {
				t.Errorf("since %s: flow #%d from %s at %s", mid.Format(time.RFC3339Nano), f.ID, f.Client, f.Time.Format(time.RFC3339Nano))
			}
			phases = append(phases, f.Phase)
		}
		if want := []string{"start", "dial", "first-byte", "end"}; !slices.Equal(phases, want) {
			t.Errorf("since %s: phases %v, want %v:%s", mid.Format(time.RFC3339Nano), phases, want, ovBrief(fs))
		}
		// A duration reaches back from now: an hour covers all six ends.
		fs, err = ovGet(n, ovQuery("namespace", ns, "phase", "end", "since", "1h"))
		if err != nil || len(fs) < 6 {
			t.Errorf("since=1h: %d end events, %v; want at least the 6", len(fs), err)
		}
		fs, err = ovCLI(n, "-n", ns, "--since", "1h")
		if err != nil || len(fs) < 6 {
			t.Errorf("observe --since 1h: %d end events, %v; want at least the 6", len(fs), err)
		}
	})

	t.Run("bad_parameters_are_400_naming_them", func(t *testing.T) {
		for _, q := range []string{"verdict=bogus", "last=-1", "client=not-an-ip", "since=yesterday", "colour=red"} {
			code, body, err := httpGet(n.bed.Node, "http://"+metricsAddr+"/debug/flows?"+q)
			name, _, _ := strings.Cut(q, "=")
			if err != nil || code != http.StatusBadRequest || !strings.Contains(body, name) {
				t.Errorf("GET /debug/flows?%s: %d %q, %v; want 400 naming %s", q, code, body, err, name)
			}
		}
	})

	t.Run("follow_raw", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				var c net.Conn
				err := n.bed.Node.Do(func() (err error) {
					c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
					return err
				})
				return c, err
			}}}
		// since= now: a flow made before the server subscribed is still sent.
		q := ovQuery("follow", "1", "service", ns+"/alpha", "phase", "end", "since", time.Now().Format(time.RFC3339Nano))
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+metricsAddr+"/debug/flows?"+q.Encode(), nil)
		if err != nil {
			t.Fatal(err)
		}
		type result struct {
			resp *http.Response
			err  error
		}
		got := make(chan result, 1)
		go func() { resp, err := hc.Do(req); got <- result{resp, err} }()
		first := ovRequest(t, n.bed.Client, a.clusterTCP)
		res := <-got
		if res.err != nil {
			t.Fatal(res.err)
		}
		defer res.resp.Body.Close()
		if ct := res.resp.Header.Get("Content-Type"); !strings.Contains(ct, "ndjson") {
			t.Errorf("Content-Type %q, want application/x-ndjson", ct)
		}
		ch := ovFollow(t, ctx, res.resp.Body)
		ovNext(t, ch, first, "follow, the first new flow")
		// The stream stays open: a flow made now arrives too.
		second := ovRequest(t, n.bed.Client, a.clusterTCP)
		f := ovNext(t, ch, second, "follow, a flow made while the stream is open")
		if f.Service != "alpha" || f.Verdict != "forwarded" || f.Phase != "end" {
			t.Errorf("followed flow %s", ovBrief([]observe.Flow{f}))
		}
		cancel()
	})

	t.Run("follow_cli", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		cmd := exec.CommandContext(ctx, "ip", "netns", "exec", n.bed.Node.Name, proxyBinary, "observe", "-o", "json",
			"--address", metricsAddr, "--follow", "--service", ns+"/alpha", "--since", time.Now().Format(time.RFC3339Nano))
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() {
			cancel()
			_ = cmd.Wait()
			if t.Failed() {
				t.Logf("observe stderr: %s", stderr.String())
			}
		}()
		ch := ovFollow(t, ctx, out)
		first := ovRequest(t, n.bed.Client, a.clusterTCP)
		ovNext(t, ch, first, "observe --follow, the first new flow")
		second := ovRequest(t, n.bed.Client, a.clusterTCP)
		ovNext(t, ch, second, "observe --follow, a flow made while it runs")
	})
}
