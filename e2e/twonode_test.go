package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"net/url"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// A two-node cluster (internal/testbed.NewCluster for the address plan): node A in zone-a and
// node B in zone-b, each running its own proxy as system:kube-proxy with --hostname-override
// set to its Node object, and each with two pods serving TCP 8080 and UDP 5353. By the scenarios'
// convention pod 1 of a node is the backend ("webserver") and pod 2 the client ("pause pod").
// No controller runs, so the scenarios write the EndpointSlices the EndpointSlice controller
// would write (nodeName, zone, conditions, hints) themselves.

// Upstream timeouts (kubernetes test/e2e/framework/service and test/e2e/network/service.go).
const (
	// kubeProxyEndpointLagTimeout bounds how long a proxy may take to notice an endpoint change.
	kubeProxyEndpointLagTimeout = 30 * time.Second
	// upstreamPoll is the interval of upstream's polling loops (framework.Poll).
	upstreamPoll = 2 * time.Second
	// hostnameTimeout and hostnameRequestTimeout are execHostnameTest's: retry for 2 minutes,
	// each request with `curl --max-time 30`.
	hostnameTimeout        = 2 * time.Minute
	hostnameRequestTimeout = 30 * time.Second
	// failConnectTimeout is the `curl --connect-timeout 5` of the checks that expect failure.
	failConnectTimeout = 5 * time.Second
	// syncTimeout bounds waiting for both proxies to show a service (not upstream: it replaces
	// waiting for pods to become ready, and it is what a sync takes, well under a second here).
	syncTimeout = kubeProxyEndpointLagTimeout
)

// twoNodes is the shared two-node cluster of TestTwoNodes: its namespaces, Node objects, proxies
// and a Kubernetes namespace for the scenarios' Services and EndpointSlices.
type twoNodes struct {
	cluster   *testbed.Cluster
	nodes     []*node
	namespace string
	admin     kubernetes.Interface
}

// node is one node of the cluster as the API and its proxy see it.
type node struct {
	*testbed.Node
	// name is the Node object's name and the proxy's --hostname-override.
	name  string
	zone  string
	proxy *proxyProcess
}

// backend and client are pod 1 and pod 2 of the node.
func (n *node) backend() *testbed.Pod { return n.Pods[0] }
func (n *node) client() *testbed.Pod  { return n.Pods[1] }

// newTwoNodes builds the cluster and starts both proxies; everything is removed when t ends.
func newTwoNodes(t *testing.T) *twoNodes {
	t.Helper()
	return newTwoNodesWith(t, nil)
}

// newTwoNodesWith is newTwoNodes with a hook: perNode, if set, is called for each node before
// its proxy starts, with the cluster so far, the address of the node's API relay and the node's
// directory, and returns more flags for its proxy.
func newTwoNodesWith(t *testing.T, perNode func(c *twoNodes, i int, n *node, relay, dir string) []string) *twoNodes {
	t.Helper()
	requireControlPlane(t)
	lab := netns.NewTestLab(t)
	cluster, err := testbed.NewCluster(t.Context(), lab, 2)
	if err != nil {
		t.Fatalf("test namespaces: %v", err)
	}
	stop, err := cluster.ServePods(context.Background(), 8080, 5353)
	if err != nil {
		t.Fatalf("backends: %v", err)
	}
	t.Cleanup(stop)

	c := &twoNodes{cluster: cluster, namespace: uniqueName(t), admin: adminClient(t)}
	ctx := t.Context()
	if _, err := c.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: c.namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", c.namespace, err)
	}
	var names []string
	for i, tn := range cluster.Nodes {
		n := &node{Node: tn, name: fmt.Sprintf("%s-%c", c.namespace, 'a'+i), zone: fmt.Sprintf("zone-%c", 'a'+i)}
		c.nodes = append(c.nodes, n)
		names = append(names, n.name)
	}
	t.Cleanup(func() { deleteTestObjects(t, c.admin, c.namespace, names...) })

	server, err := url.Parse(controlPlane.Server)
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range c.nodes {
		obj := &corev1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: n.name, Labels: map[string]string{
				corev1.LabelHostname:     n.name,
				corev1.LabelTopologyZone: n.zone,
			}},
			Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{
				{Type: corev1.NodeInternalIP, Address: n.IP.String()},
				{Type: corev1.NodeHostName, Address: n.name},
			}},
		}
		if _, err := c.admin.CoreV1().Nodes().Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %s: %v", n.name, err)
		}
		dir := t.TempDir()
		relay := startRelay(t, n.NS, server.Host)
		kubeconfig := filepath.Join(dir, "kube-proxy.kubeconfig")
		if err := framework.WriteRelayedKubeconfig(controlPlane.ProxyKubeconfig, kubeconfig, "https://"+relay.Addr()); err != nil {
			t.Fatal(err)
		}
		// A one-second sync period bounds how long waitSynced waits for a sync after a change.
		args := []string{"--kubeconfig=" + kubeconfig, "--hostname-override=" + n.name, "--iptables-sync-period=1s"}
		if perNode != nil {
			args = append(args, perNode(c, i, n, relay.Addr(), dir)...)
		}
		n.proxy = startProxy(t, n.NS, dir, proxyArgs(args...)...)
	}
	return c
}

// service creates a Service in the cluster's namespace (the scenarios share it, so each names
// its services differently).
func (c *twoNodes) service(t *testing.T, name string, spec corev1.ServiceSpec) *corev1.Service {
	t.Helper()
	return createService(t, c.admin, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.namespace}, Spec: spec})
}

// conditions are an endpoint's EndpointSlice conditions.
type conditions struct{ ready, serving, terminating bool }

var (
	// readyPod is a running, ready pod.
	readyPod = conditions{ready: true, serving: true}
	// terminatingServingPod is a deleted pod still passing its readiness probe during its grace
	// period: the controller publishes ready=false (a terminating pod is never ready), serving=true.
	terminatingServingPod = conditions{serving: true, terminating: true}
)

// endpoint is one endpoint of a hand-made EndpointSlice.
type endpoint struct {
	addr netip.Addr
	node *node
	cond conditions
	// zones are the zone hints; none means no hints.
	zones []string
}

// podEndpoint is pod's endpoint on n.
func podEndpoint(n *node, pod *testbed.Pod, cond conditions, zones ...string) endpoint {
	return endpoint{addr: pod.IP, node: n, cond: cond, zones: zones}
}

// setSlice makes svc's single EndpointSlice list eps, with one slice port per service port
// (named like it, on its numeric target port), as the EndpointSlice controller would.
func (c *twoNodes) setSlice(t *testing.T, svc *corev1.Service, eps ...endpoint) {
	t.Helper()
	want := sliceOf(svc)
	want.Endpoints = []discoveryv1.Endpoint{} // an empty slice is what the controller writes for no pods
	for _, e := range eps {
		ep := discoveryv1.Endpoint{
			Addresses: []string{e.addr.String()},
			Conditions: discoveryv1.EndpointConditions{
				Ready: ptr(e.cond.ready), Serving: ptr(e.cond.serving), Terminating: ptr(e.cond.terminating),
			},
			NodeName: ptr(e.node.name),
			Zone:     ptr(e.node.zone),
		}
		if len(e.zones) > 0 {
			ep.Hints = &discoveryv1.EndpointHints{}
			for _, z := range e.zones {
				ep.Hints.ForZones = append(ep.Hints.ForZones, discoveryv1.ForZone{Name: z})
			}
		}
		want.Endpoints = append(want.Endpoints, ep)
	}
	applySlice(t, c.admin, want)
}

// debugService is the part of a proxy's /debug/services entry the scenarios wait on.
type debugService struct {
	Name      string `json:"name"`
	Endpoints []struct {
		Address     string `json:"address"`
		Ready       bool   `json:"ready"`
		Serving     bool   `json:"serving"`
		Terminating bool   `json:"terminating"`
	} `json:"endpoints"`
}

// waitSynced waits until both proxies know every port of svc with exactly the endpoints eps
// (addresses and conditions, whatever they do with them) and have finished a sync since. It stands
// in for upstream's wait for pods and endpoints, without assuming how a proxy programs a policy
// (a portal, a reject rule or nothing at all); traffic checks follow it.
func (c *twoNodes) waitSynced(t *testing.T, svc *corev1.Service, eps ...endpoint) {
	t.Helper()
	var want []string
	for _, e := range eps {
		want = append(want, fmt.Sprintf("%s r=%t s=%t t=%t", e.addr, e.cond.ready, e.cond.serving, e.cond.terminating))
	}
	slices.Sort(want)
	for _, n := range c.nodes {
		eventually(t, syncTimeout, fmt.Sprintf("proxy on %s never showed %s/%s", n.name, svc.Namespace, svc.Name), func() error {
			if err := n.proxy.exited(); err != nil {
				return err
			}
			return debugHasService(n.NS, svc, want)
		})
		known := time.Now()
		// The proxies sync at least every second (newTwoNodes), so this takes at most about that.
		eventually(t, syncTimeout, fmt.Sprintf("proxy on %s never synced after learning %s/%s", n.name, svc.Namespace, svc.Name), func() error {
			last, err := lastSync(n.NS)
			if err != nil {
				return err
			}
			if !last.After(known) {
				return fmt.Errorf("last sync %v is not after %v", last, known)
			}
			return nil
		})
	}
}

// lastSync reads the proxy's kubeproxy_sync_proxy_rules_last_timestamp_seconds.
func lastSync(ns *netns.NS) (time.Time, error) {
	const metric = "kubeproxy_sync_proxy_rules_last_timestamp_seconds "
	code, body, err := httpGet(ns, "http://"+metricsAddr+"/metrics")
	if err != nil {
		return time.Time{}, err
	}
	if code != 200 {
		return time.Time{}, fmt.Errorf("/metrics: %d", code)
	}
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, metric); ok {
			secs, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return time.Time{}, fmt.Errorf("/metrics: %q: %w", line, err)
			}
			return time.Unix(0, int64(secs*1e9)), nil
		}
	}
	return time.Time{}, fmt.Errorf("/metrics: no %s", strings.TrimSpace(metric))
}

func debugHasService(ns *netns.NS, svc *corev1.Service, want []string) error {
	code, body, err := httpGet(ns, "http://"+metricsAddr+"/debug/services?format=json")
	if err != nil {
		return err
	}
	if code != 200 {
		return fmt.Errorf("/debug/services: %d %s", code, body)
	}
	var views []debugService
	if err := json.Unmarshal([]byte(body), &views); err != nil {
		return fmt.Errorf("/debug/services: %w", err)
	}
	for _, p := range svc.Spec.Ports {
		name := fmt.Sprintf("%s/%s:%s", svc.Namespace, svc.Name, p.Name)
		i := slices.IndexFunc(views, func(v debugService) bool { return v.Name == name })
		if i < 0 {
			return fmt.Errorf("service port %s not known yet", name)
		}
		got := []string{}
		for _, e := range views[i].Endpoints {
			addr, _, _ := strings.Cut(e.Address, ":")
			got = append(got, fmt.Sprintf("%s r=%t s=%t t=%t", addr, e.Ready, e.Serving, e.Terminating))
		}
		slices.Sort(got)
		if !slices.Equal(want, got) {
			return fmt.Errorf("endpoints of %s (-want +got):\n%s", name, cmp.Diff(want, got))
		}
	}
	return nil
}

// expectHostname is upstream's execHostnameTest: from ns, ask addr for its name, retrying on
// errors every 2 s for up to 2 minutes (each try bounded by 30 s); the first answer must be want.
func expectHostname(t *testing.T, from *netns.NS, addr netip.AddrPort, want string) {
	t.Helper()
	deadline := time.Now().Add(hostnameTimeout)
	for {
		got, err := testbed.Who(from, addr, hostnameRequestTimeout)
		if err == nil {
			if got != want {
				t.Fatalf("%s -> %s answered by %q, want %q", from.Name, addr, got, want)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s -> %s: no answer within %v: %v", from.Name, addr, hostnameTimeout, err)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("%s -> %s: %v", from.Name, addr, t.Context().Err())
		case <-time.After(upstreamPoll):
		}
	}
}

// expectNoAnswer is upstream's `curl --connect-timeout 5 ...` that must fail: from ns, a TCP
// connection to addr must fail or close without the backend's greeting.
func expectNoAnswer(t *testing.T, from *netns.NS, addr netip.AddrPort, why string) {
	t.Helper()
	if got, err := testbed.Who(from, addr, failConnectTimeout); err == nil {
		t.Fatalf("%s -> %s answered by %q: expected an error (%s)", from.Name, addr, got, why)
	}
}

// clusterIP and nodePort are the addresses of svc's port i.
func clusterIP(svc *corev1.Service, i int) netip.AddrPort {
	return netip.AddrPortFrom(netip.MustParseAddr(svc.Spec.ClusterIP), uint16(svc.Spec.Ports[i].Port))
}

func nodePort(svc *corev1.Service, n *node, i int) netip.AddrPort {
	return netip.AddrPortFrom(n.IP, uint16(svc.Spec.Ports[i].NodePort))
}
