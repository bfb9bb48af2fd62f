package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"regexp"
	"strconv"
	"strings"
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

// The transparent source mode (--source-mode, docs/transparent.md): the proxy dials the endpoint
// from the client's own address and port, so the endpoint sees the client, not the node.
//
// Address plan: the two-node cluster's (internal/testbed.NewCluster). Node A is 172.31.0.1 with
// a-pod1 10.244.11.10 (the backend: its link's node end is 10.244.11.1) and a-pod2 10.244.12.10
// (a client on the endpoint's node); node B is 172.31.0.2 with b-pod2 10.244.22.10 (a client on
// the other node). Pods are routed, not bridged. Node A's pod CIDR is 10.244.8.0/21, from its
// Node object's spec.podCIDRs; node B's is 10.244.16.0/21, from --node-pod-cidr. In a-pod1 a real
// nginx (TCP tpTCPPort) and socat (UDP tpUDPPort) answer every request with the peer address and
// port they saw. The IPv6 test uses the single-node plan of ipv6_test.go.

const (
	// tpTCPPort and tpUDPPort are the peer backends' ports in the backend pod (the testbed's own
	// servers hold 8080 and 5353).
	tpTCPPort = 8081
	tpUDPPort = 5354
)

var (
	tpPodCIDRA = netip.MustParsePrefix("10.244.8.0/21")
	tpPodCIDRB = netip.MustParsePrefix("10.244.16.0/21")
	tpV6CIDR   = netip.MustParsePrefix("fd00:244:1::/64")
	// tpNodeAToBackend is node A's end of a-pod1's link: the address node A dials a-pod1 from.
	tpNodeAToBackend = netip.MustParseAddr("10.244.11.1")
)

// tpPorts are the ports of the test's Services: TCP 80 and UDP 53 to the peer backends.
func tpPorts() []corev1.ServicePort {
	return []corev1.ServicePort{
		{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(tpTCPPort)},
		{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(tpUDPPort)},
	}
}

// tpDialer dials from ns over network ("tcp" or "udp"), each dial bounded by requestTimeout.
func tpDialer(ns *netns.NS, network string) func(netip.AddrPort) (net.Conn, error) {
	return func(a netip.AddrPort) (net.Conn, error) {
		var c net.Conn
		err := ns.Do(func() error {
			var err error
			c, err = net.DialTimeout(network, a.String(), requestTimeout)
			return err
		})
		return c, err
	}
}

// tpAsk asks the peer backend behind addr (over proto), from ns, which address it saw the
// request come from. It retries failed requests (each bounded by requestTimeout) every
// upstreamPoll for up to timeout, as expectHostname does, and returns the first answer: the
// client socket's own address and the peer the backend saw.
func tpAsk(t *testing.T, from *netns.NS, proto corev1.Protocol, addr netip.AddrPort, timeout time.Duration) (local, seen netip.AddrPort) {
	t.Helper()
	ask := testenv.AskNginxPeer
	dial := tpDialer(from, "tcp")
	if proto == corev1.ProtocolUDP {
		ask, dial = testenv.AskSocatPeer, tpDialer(from, "udp")
	}
	deadline := time.Now().Add(timeout)
	for {
		local, seen, err := ask(dial, addr, requestTimeout)
		if err == nil {
			return local, seen
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %s -> %s: no answer within %v: %v", proto, from.Name, addr, timeout, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("%s %s -> %s: %v", proto, from.Name, addr, t.Context().Err())
		case <-time.After(upstreamPoll):
		}
	}
}

// tpStartBackends runs the peer backends in pod, waiting until they answer a request from via
// (the pod's node).
func tpStartBackends(t *testing.T, pod *netns.NS, ip netip.Addr, via *netns.NS) {
	t.Helper()
	prefix := pod.CommandPrefix()
	testenv.StartNginxPeer(t, netip.AddrPortFrom(ip, tpTCPPort), prefix, tpDialer(via, "tcp"))
	testenv.StartSocatPeer(t, netip.AddrPortFrom(ip, tpUDPPort), prefix, tpDialer(via, "udp"))
}

// tpLabel is one label of a series in the text exposition: name="value" (value escaped).
var tpLabel = regexp.MustCompile(`(\w+)="((?:[^"\\]|\\.)*)"`)

// tpSourceMode reads kube_portal_proxy_source_mode from the proxy in ns: the mode whose series is
// 1, and its reason label.
func tpSourceMode(ns *netns.NS) (mode, reason string, err error) {
	code, body, err := httpGet(ns, "http://"+metricsAddr+"/metrics")
	if err != nil || code != http.StatusOK {
		return "", "", fmt.Errorf("GET /metrics: %d, %v", code, err)
	}
	const name = "kube_portal_proxy_source_mode{"
	for line := range strings.Lines(body) {
		labels, ok := strings.CutPrefix(strings.TrimSpace(line), name)
		if !ok {
			continue
		}
		labels, value, _ := strings.Cut(labels, "} ")
		if v, err := strconv.ParseFloat(value, 64); err != nil || v != 1 {
			continue
		}
		for _, m := range tpLabel.FindAllStringSubmatch(labels, -1) {
			v, _ := strconv.Unquote(`"` + m[2] + `"`)
			switch m[1] {
			case "mode":
				mode = v
			case "reason":
				reason = v
			}
		}
		return mode, reason, nil
	}
	return "", "", fmt.Errorf("no %s...} 1 in /metrics", name)
}

// tpExpectTransparent marks t failed (the traffic checks still run, to show what the endpoints see) unless the proxy in ns reports the transparent source mode.
// The plumbing is installed right after the sockets serve, so the mode turns transparent within
// the start (syncTimeout bounds it).
func tpExpectTransparent(t *testing.T, node string, ns *netns.NS) {
	t.Helper()
	var mode, reason string
	var err error
	deadline := time.Now().Add(syncTimeout)
	for {
		if mode, reason, err = tpSourceMode(ns); (err == nil && mode == "transparent") || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond) // polling the proxy's metric, not synchronising
	}
	if err != nil || mode != "transparent" {
		t.Errorf("kube_portal_proxy_source_mode on %s: mode %q (reason %q), %v; want transparent within %v", node, mode, reason, err, syncTimeout)
	}
}

// tpFlowSource follows the flow stream of the proxy in ns (the data path records a flow's source
// only while someone watches: flow.Observed), makes one connection with connect, and returns the
// connection's client address and the source of its endpoint leg in its End event.
func tpFlowSource(t *testing.T, ns *netns.NS, service string, connect func() netip.AddrPort) (client netip.AddrPort, source string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*requestTimeout+10*time.Second)
	defer cancel()
	q := url.Values{"service": {service}, "phase": {"end"}, "follow": {"1"}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+metricsAddr+"/debug/flows?"+q.Encode(), nil)
	if err != nil {
		t.Fatal(err)
	}
	hc := nodeHTTP(ns)
	hc.Timeout = 0 // the context bounds the stream
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("follow /debug/flows: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("follow /debug/flows: %s", resp.Status)
	}
	// The headers come after the observer subscribed: every flow from now on is in the stream.
	client = connect()
	var ends []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var it observe.Item
		if err := json.Unmarshal(sc.Bytes(), &it); err != nil {
			t.Fatalf("/debug/flows line %q: %v", sc.Text(), err)
		}
		if it.Flow == nil {
			continue
		}
		if it.Flow.Client == client.String() {
			return client, it.Flow.Source
		}
		ends = append(ends, it.Flow.Client)
	}
	t.Fatalf("no End of %s's flow in /debug/flows (ends of %v): %v", client, ends, sc.Err())
	return client, ""
}

// TestTransparentSourceTwoNodes runs both proxies of the two-node cluster in the transparent
// source mode (the default, auto, where the node supports it), on each TCP engine, with a Service
// whose endpoint is a-pod1 on node A. Through the cluster IP, over TCP and UDP, the backend sees
// the client pod's own address and port, for a client on the endpoint's node (a-pod2: node A's
// proxy dials) and one on the other node (b-pod2: node B's proxy dials, and node A routes the
// reply back to node B); and for b-pod2 through node A's node port (externalTrafficPolicy Local).
// A Service annotated source-mode: proxy keeps today's behaviour: the backend sees the dialing
// node's address on its route to the pod (10.244.11.1 from node A, 172.31.0.2 from node B). Both
// proxies report the transparent mode in kube_portal_proxy_source_mode, and the flow stream shows
// the client's address as the endpoint leg's source.
func TestTransparentSourceTwoNodes(t *testing.T) {
	t.Parallel()
	for _, v := range []struct{ name, engine, portals string }{
		{tcp.EngineIOUring, tcp.EngineIOUring, "iptables"},
		{tcp.EngineEpoll, tcp.EngineEpoll, "iptables"},
		// Bind mode: the service IPs are local addresses of the node, the sockets listen on them;
		// the dial and the reply steering are the same.
		{"bind", tcp.EngineIOUring, "bind"},
	} {
		t.Run(v.name, func(t *testing.T) {
			if v.engine == tcp.EngineIOUring {
				if err := tcp.ProbeIOUring(); err != nil {
					testenv.Unavailable(t, "io_uring unavailable: %v", err)
				}
			}
			tpTwoNodes(t, v.engine, v.portals)
		})
	}
}

func tpTwoNodes(t *testing.T, engine, portals string) {
	c := newTwoNodesWith(t, func(c *twoNodes, i int, n *node, _, _ string) []string {
		args := []string{"--io-engine=" + engine, "--portal-mode=" + portals}
		if i == 1 {
			return append(args, "--node-pod-cidr="+tpPodCIDRB.String())
		}
		// Node A learns its pod CIDR from its Node object, as on a cluster whose controller
		// manager allocates node CIDRs.
		obj, err := c.admin.CoreV1().Nodes().Get(t.Context(), n.name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get node %s: %v", n.name, err)
		}
		obj.Spec.PodCIDR, obj.Spec.PodCIDRs = tpPodCIDRA.String(), []string{tpPodCIDRA.String()}
		if _, err := c.admin.CoreV1().Nodes().Update(t.Context(), obj, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("set node %s's pod CIDR: %v", n.name, err)
		}
		// Node A routes its pods (a link each, no bridge) and has br_netfilter off, as a node
		// of a routed CNI may: no reply between two of its pods is bridged, so its same-node
		// client keeps its address without the bridge part. The sysctl is the node namespace's
		// own; a host without br_netfilter has no such file and is in that state already.
		for _, f := range []string{"bridge-nf-call-iptables", "bridge-nf-call-ip6tables"} {
			path := "/proc/sys/net/bridge/" + f
			if _, err := n.NS.Exec(t.Context(), "sh", "-c", "[ ! -e "+path+" ] || echo 0 > "+path); err != nil {
				t.Fatalf("node %s: %s off: %v", n.name, f, err)
			}
		}
		return args
	})
	a, b := c.nodes[0], c.nodes[1]
	backend := a.backend()
	tpStartBackends(t, backend.NS, backend.IP, a.NS)

	on := c.service(t, "tp-on", corev1.ServiceSpec{Type: corev1.ServiceTypeNodePort,
		ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyLocal, Ports: tpPorts()})
	off := createService(t, c.admin, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "tp-off", Namespace: c.namespace,
			Annotations: map[string]string{proxier.AnnotationSourceMode: "proxy"}},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, Ports: tpPorts()},
	})
	ep := podEndpoint(a, backend, readyPod)
	for _, svc := range []*corev1.Service{on, off} {
		c.setSlice(t, svc, ep)
		c.waitSynced(t, svc, ep)
	}
	for _, n := range c.nodes {
		tpExpectTransparent(t, n.name, n.NS)
	}
	// /debug/services says which ports dial from the client's address: the annotated one does not.
	code, body, err := httpGet(a.NS, "http://"+metricsAddr+"/debug/services?format=json")
	if err != nil || code != http.StatusOK {
		t.Fatalf("GET /debug/services: %d %v", code, err)
	}
	var views []struct{ Name, SourceMode string }
	if err := json.Unmarshal([]byte(body), &views); err != nil {
		t.Fatal(err)
	}
	modes := map[string]string{}
	for _, v := range views {
		modes[v.Name] = v.SourceMode
	}
	for _, svc := range []*corev1.Service{on, off} {
		want := "transparent"
		if svc == off {
			want = ""
		}
		for _, p := range svc.Spec.Ports {
			if name := svc.Namespace + "/" + svc.Name + ":" + p.Name; modes[name] != want {
				t.Errorf("/debug/services: %s sourceMode %q, want %q", name, modes[name], want)
			}
		}
	}

	// Today's behaviour first: it also proves both paths serve before the cases that may not.
	t.Run("source_mode_proxy_annotation", func(t *testing.T) {
		for _, cl := range []struct {
			from *node
			want netip.Addr // the dialing node's address on its route to a-pod1
		}{
			{a, tpNodeAToBackend},
			{b, b.IP},
		} {
			for i, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP} {
				local, seen := tpAsk(t, cl.from.client().NS, proto, clusterIP(off, i), hostnameTimeout)
				if seen.Addr() != cl.want || seen == local {
					t.Errorf("%s %s -> %s (source-mode proxy): backend saw %v; want %v, the address of %s, not the client's %v",
						proto, cl.from.client().Name, clusterIP(off, i), seen, cl.want, cl.from.name, local)
				}
			}
		}
	})

	for _, tt := range []struct {
		name string
		from *testbed.Pod
		addr func(i int) netip.AddrPort
	}{
		{"cluster_IP_client_on_the_endpoints_node", a.client(), func(i int) netip.AddrPort { return clusterIP(on, i) }},
		{"cluster_IP_client_on_the_other_node", b.client(), func(i int) netip.AddrPort { return clusterIP(on, i) }},
		{"node_port_local_endpoint_client_on_the_other_node", b.client(), func(i int) netip.AddrPort { return nodePort(on, a, i) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for i, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP} {
				local, seen := tpAsk(t, tt.from.NS, proto, tt.addr(i), syncTimeout)
				if seen != local {
					t.Errorf("%s %s -> %s: backend saw %v; want the client's own %v", proto, tt.from.Name, tt.addr(i), seen, local)
				}
			}
		})
	}

	t.Run("flow_source_is_the_client", func(t *testing.T) {
		var seen netip.AddrPort
		local, src := tpFlowSource(t, b.NS, on.Namespace+"/"+on.Name, func() (local netip.AddrPort) {
			local, seen = tpAsk(t, b.client().NS, corev1.ProtocolTCP, clusterIP(on, 0), syncTimeout)
			return local
		})
		if src != local.String() {
			t.Errorf("flow of %s on %s: endpoint leg's source %q; want the client's %q (the backend saw %v)", local, b.name, src, local, seen)
		}
	})
}

// IPv6: the single-node plan of ipv6_test.go. The client fd00:30::2 is routed via the node, the
// peer backends run in pod1 fd00:244:1::10 (node end fd00:244:1::1), the node's pod CIDR is
// fd00:244:1::/64 (--node-pod-cidr: the services file has no Node object). tp6 at fd00:96::30
// takes the node's default (transparent); tp6-off at fd00:96::31 is annotated source-mode: proxy.
var (
	tpV6On  = netip.MustParseAddr("fd00:96::30")
	tpV6Off = netip.MustParseAddr("fd00:96::31")
)

func tpV6Manifest() string {
	svc := func(name string, ip netip.Addr, annotations string) string {
		return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: %[2]s
  namespace: %[1]s
  annotations: {%[4]s}
spec:
  ipFamilies: [IPv6]
  clusterIP: %[3]s
  clusterIPs: [%[3]q]
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: %[5]d}
  - {name: dns, protocol: UDP, port: 53, targetPort: %[6]d}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %[2]s-1
  namespace: %[1]s
  labels: {kubernetes.io/service-name: %[2]s}
addressType: IPv6
ports:
- {name: http, protocol: TCP, port: %[5]d}
- {name: dns, protocol: UDP, port: %[6]d}
endpoints:
- addresses: [%[7]q]
  conditions: {ready: true}
---
`, fileNamespace, name, ip, annotations, tpTCPPort, tpUDPPort, v6Pod)
	}
	return svc("tp6", tpV6On, "") + svc("tp6-off", tpV6Off, fmt.Sprintf("%q: proxy", proxier.AnnotationSourceMode))
}

// TestTransparentSourceIPv6: on IPv6, with the endpoint a pod of the node, the backend sees a
// routed client's own address and port over TCP and UDP, on each TCP engine; a Service annotated
// source-mode: proxy sees the node's address on the pod's link (fd00:244:1::1). With the mode off
// on the node (--source-mode=proxy) both Services see the node's address, as before the mode
// existed, and the metric says proxy and why.
func TestTransparentSourceIPv6(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, engine, sourceMode string
	}{
		{"io_uring", tcp.EngineIOUring, ""},
		{"epoll", tcp.EngineEpoll, ""},
		{"node_source_mode_proxy", tcp.EngineEpoll, "proxy"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.engine == tcp.EngineIOUring {
				if err := tcp.ProbeIOUring(); err != nil {
					testenv.Unavailable(t, "io_uring unavailable: %v", err)
				}
			}
			b := newV6Bed(t)
			tpStartBackends(t, b.pod, v6Pod, b.node)
			dir, write := servicesDir(t)
			write(tpV6Manifest())
			args := []string{"--services-file=" + dir, "--io-engine=" + tt.engine, "--node-pod-cidr=" + tpV6CIDR.String()}
			if tt.sourceMode != "" {
				args = append(args, "--source-mode="+tt.sourceMode)
			}
			proxy := startProxy(t, b.node, t.TempDir(), proxyArgs(args...)...)
			eventually(t, syncTimeout, "the proxy to serve", func() error {
				if err := proxy.exited(); err != nil {
					return err
				}
				_, _, err := testenv.AskNginxPeer(tpDialer(b.client, "tcp"), netip.AddrPortFrom(tpV6Off, 80), requestTimeout)
				return err
			})
			transparent := tt.sourceMode == ""
			if transparent {
				tpExpectTransparent(t, "the node", b.node)
			} else if mode, reason, err := tpSourceMode(b.node); err != nil || mode != "proxy" || reason != "the node runs with --source-mode=proxy" {
				t.Errorf("kube_portal_proxy_source_mode: mode %q, reason %q, %v; want proxy because of the flag", mode, reason, err)
			}
			for i, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP} {
				port := []uint16{80, 53}[i]
				t.Run(string(proto), func(t *testing.T) {
					off := netip.AddrPortFrom(tpV6Off, port)
					if local, seen := tpAsk(t, b.client, proto, off, hostnameTimeout); seen.Addr() != v6NodePod || seen == local {
						t.Errorf("%s client -> %s (source-mode proxy): backend saw %v; want the node's %v, not the client's %v", proto, off, seen, v6NodePod, local)
					}
					on := netip.AddrPortFrom(tpV6On, port)
					local, seen := tpAsk(t, b.client, proto, on, syncTimeout)
					switch {
					case transparent && seen != local:
						t.Errorf("%s client -> %s: backend saw %v; want the client's own %v", proto, on, seen, local)
					case !transparent && (seen.Addr() != v6NodePod || seen == local):
						t.Errorf("%s client -> %s (node --source-mode=proxy): backend saw %v; want the node's %v, not the client's %v", proto, on, seen, v6NodePod, local)
					}
				})
			}
		})
	}
}
