package e2e

import (
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// webSpec is the service most scenarios use: TCP 80 -> 8080 ("http") and UDP 53 -> 5353 ("dns"),
// the ports the testbed backends serve.
func webSpec(typ corev1.ServiceType, externalIPs ...string) corev1.ServiceSpec {
	return corev1.ServiceSpec{
		Type:        typ,
		ExternalIPs: externalIPs,
		Ports: []corev1.ServicePort{
			{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080)},
			{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(5353)},
		},
	}
}

// targets are the addresses one web service is reachable on.
type targets struct {
	// namespace is the service's Kubernetes namespace, which names its portal rules.
	namespace string
	// nodeIP is the node IP the proxy chose: the DNAT target of the node's own traffic.
	nodeIP     netip.Addr
	clusterTCP netip.AddrPort // cluster IP, http
	clusterUDP netip.AddrPort // cluster IP, dns
	nodePort   netip.AddrPort // node IP, http node port
	externalIP netip.AddrPort // external IP, http
}

func targetsOf(t *testing.T, svc *corev1.Service) targets {
	t.Helper()
	ip, err := netip.ParseAddr(svc.Spec.ClusterIP)
	if err != nil {
		t.Fatalf("service %s/%s cluster IP %q: %v", svc.Namespace, svc.Name, svc.Spec.ClusterIP, err)
	}
	// The Node object's InternalIP (newClusterNode) is the node IP.
	tg := targets{namespace: svc.Namespace, nodeIP: testbed.NodeExtIP, clusterTCP: netip.AddrPortFrom(ip, 80), clusterUDP: netip.AddrPortFrom(ip, 53)}
	if np := svc.Spec.Ports[0].NodePort; np != 0 {
		tg.nodePort = netip.AddrPortFrom(testbed.NodeExtIP, uint16(np))
	}
	if len(svc.Spec.ExternalIPs) > 0 {
		tg.externalIP = netip.AddrPortFrom(netip.MustParseAddr(svc.Spec.ExternalIPs[0]), 80)
	}
	return tg
}

// TestServiceTraffic serves a NodePort service with an external IP, TCP and UDP ports and three
// endpoints, and checks every way into it.
func TestServiceTraffic(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 3)
	svc := n.createService(t, "web", webSpec(corev1.ServiceTypeNodePort, externalIP()))
	n.setEndpoints(t, svc, 1, 2, 3)
	proxy := n.startProxy(t)
	checkTraffic(t, n.bed, proxy, targetsOf(t, svc), podNames(1, 2, 3))
}

// checkTraffic waits for the portals of tg to answer, then checks each path into the service,
// that round robin spreads evenly over pods, and health. Shared by the API and file modes.
func checkTraffic(t *testing.T, bed *testbed.Bed, proxy *proxyProcess, tg targets, pods []string) {
	t.Helper()
	proxy.waitAnswers(t, bed.Client, tg.clusterTCP, "the cluster IP portal never answered")

	// answeredByAll checks that a few requests from ns reach every pod: strict round robin over
	// n pods answers each exactly twice in 2n requests.
	answeredByAll := func(t *testing.T, ns *netns.NS, addr netip.AddrPort) {
		t.Helper()
		if got := keys(tally(t, whoTCP, ns, addr, 2*len(pods))); !cmp.Equal(pods, got) {
			t.Errorf("pods answering %s from %s (-want +got):\n%s", addr, ns.Name, cmp.Diff(pods, got))
		}
	}
	// viaChain checks that traffic went through the service's rules in chain, with the target.
	viaChain := func(t *testing.T, chain, target string, send func()) {
		t.Helper()
		before := rules(t, bed.Node).of(tg.namespace).in(chain)
		send()
		after := rules(t, bed.Node).of(tg.namespace).in(chain)
		if len(after) == 0 {
			t.Fatalf("no %s rule for %s in the node namespace", chain, tg.namespace)
		}
		for _, r := range after {
			if !strings.Contains(r.text, target) {
				t.Errorf("rule %q: want target %q", r.text, target)
			}
		}
		if after.packets() <= before.packets() {
			t.Errorf("%s rules of %s matched no new packet (%d before, %d after): traffic took another path",
				chain, tg.namespace, before.packets(), after.packets())
		}
	}

	t.Run("cluster_IP_TCP_from_a_pod_is_REDIRECTed", func(t *testing.T) {
		viaChain(t, "KUBE-PORTALS-CONTAINER", "-j REDIRECT --to-ports ", func() {
			answeredByAll(t, bed.Client, tg.clusterTCP)
		})
	})
	t.Run("cluster_IP_TCP_from_the_node_is_DNATed_to_the_node_IP", func(t *testing.T) {
		viaChain(t, "KUBE-PORTALS-HOST", "-j DNAT --to-destination "+tg.nodeIP.String()+":", func() {
			answeredByAll(t, bed.Node, tg.clusterTCP)
		})
	})
	t.Run("cluster_IP_UDP_from_a_pod_answers_each_query", func(t *testing.T) {
		// Each query comes from its own socket, so it is a new session with a round-robin pick.
		got := keys(tallyUDP(t, bed.Client, tg.clusterUDP, 2*len(pods)))
		if !cmp.Equal(pods, got) {
			t.Errorf("pods answering %s from the client pod (-want +got):\n%s", tg.clusterUDP, cmp.Diff(pods, got))
		}
	})
	if tg.nodePort.IsValid() {
		t.Run("node_port_from_the_external_host", func(t *testing.T) {
			viaChain(t, "KUBE-NODEPORT-CONTAINER", "-j REDIRECT --to-ports ", func() {
				answeredByAll(t, bed.External, tg.nodePort)
			})
		})
	}
	if tg.externalIP.IsValid() {
		t.Run("external_IP_from_the_external_host", func(t *testing.T) {
			answeredByAll(t, bed.External, tg.externalIP)
		})
	}
	t.Run("round_robin_spreads_connections_evenly", func(t *testing.T) {
		const perPod = 10
		want := map[string]int{}
		for _, p := range pods {
			want[p] = perPod
		}
		got := tally(t, whoTCP, bed.Client, tg.clusterTCP, perPod*len(pods))
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("connections per pod over %d requests (-want +got):\n%s", perPod*len(pods), diff)
		}
	})
	t.Run("healthz_is_200_after_sync", func(t *testing.T) {
		checkHealthy(t, bed.Node)
	})
	t.Run("metrics_and_debug_rules_show_the_portals", func(t *testing.T) {
		code, body, err := httpGet(bed.Node, "http://"+metricsAddr+"/metrics")
		if err != nil || code != http.StatusOK {
			t.Fatalf("GET /metrics = %d, %v", code, err)
		}
		if v, ok := metricValue(body, "kube_portal_proxy_portal_rules"); !ok || v <= 0 {
			t.Errorf("/metrics: kube_portal_proxy_portal_rules = %v (present %v), want > 0", v, ok)
		}
		code, body, err = httpGet(bed.Node, "http://"+metricsAddr+"/debug/rules")
		if err != nil || code != http.StatusOK {
			t.Fatalf("GET /debug/rules = %d, %v", code, err)
		}
		if want := `"` + tg.namespace + `/`; !strings.Contains(body, want) {
			t.Errorf("/debug/rules does not mention %s:\n%s", want, body)
		}
	})
	t.Run("no_duplicate_rules", func(t *testing.T) {
		if dups := rules(t, bed.Node).duplicates(); len(dups) > 0 {
			t.Errorf("duplicate rules in the node namespace:\n%s", strings.Join(dups, "\n"))
		}
	})
}

// metricValue returns the value of an unlabelled metric in a Prometheus text exposition.
func metricValue(exposition, name string) (float64, bool) {
	for _, line := range strings.Split(exposition, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f, err == nil
		}
	}
	return 0, false
}
