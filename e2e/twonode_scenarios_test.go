package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// TestTwoNodes ports scenarios of kubernetes test/e2e/network/service.go that need two nodes,
// under their upstream names, onto one shared two-node cluster (twonode_test.go). Each scenario
// has its own Service, so they run in parallel and one runs alone with
// -run 'TestTwoNodes/<name with spaces as underscores>'.
//
// Where upstream deletes a pod or lets its readiness probe fail, the scenario rewrites the
// EndpointSlice the way the EndpointSlice controller would (no controller runs here). Upstream
// sleeps 5 s between the five rounds of checks; the rounds here follow each other at once.
func TestTwoNodes(t *testing.T) {
	t.Parallel()
	c := newTwoNodes(t)
	for _, sc := range []struct {
		name string
		run  func(*testing.T, *twoNodes)
	}{
		{"should respect internalTrafficPolicy=Local Pod to Pod", itpLocalPodToPod},
		{"should respect internalTrafficPolicy=Local Pod (hostNetwork: true) to Pod", itpLocalHostToPod},
		{"should respect internalTrafficPolicy=Local Pod and Node, to Pod (hostNetwork: true)", itpLocalToHostNetworkPod},
		{"should fail health check node port if there are only terminating endpoints", healthCheckOnlyTerminating},
		{"should fallback to terminating endpoints when there are no ready endpoints with internalTrafficPolicy=Cluster", fallbackITPCluster},
		{"should fallback to local terminating endpoints when there are no ready endpoints with internalTrafficPolicy=Local", fallbackITPLocal},
		// Upstream's name has the typo ("externall"); kept so the names match.
		{"should fallback to terminating endpoints when there are no ready endpoints with externallTrafficPolicy=Cluster", fallbackETPCluster},
		{"should fallback to local terminating endpoints when there are no ready endpoints with externalTrafficPolicy=Local", fallbackETPLocal},
		{"should be rejected when no endpoints exist", rejectedNoEndpoints},
		{"should be able to connect to terminating and unready endpoints if PublishNotReadyAddresses is true", publishNotReadyTrue},
		{"should not be able to connect to terminating and unready endpoints if PublishNotReadyAddresses is false", publishNotReadyFalse},
		// From test/e2e/network/loadbalancer.go, with the load-balancer IP written into the
		// Service's status by the test (no cloud controller runs here).
		{"should only allow access from service loadbalancer source ranges", sourceRanges},
		// Not an upstream scenario: topology-aware routing with hand-made hints.
		{"should route to endpoints hinted for the node's zone and fall back to all when a hint is missing", topologyHints},
	} {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			sc.run(t, c)
		})
	}
}

// tcpService is a one-port TCP service ("http": port -> targetPort).
func tcpService(typ corev1.ServiceType, port, targetPort int32) corev1.ServiceSpec {
	return corev1.ServiceSpec{
		Type:  typ,
		Ports: []corev1.ServicePort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: port, TargetPort: intstr.FromInt32(targetPort)}},
	}
}

func itpLocal(spec corev1.ServiceSpec) corev1.ServiceSpec {
	spec.InternalTrafficPolicy = ptr(corev1.ServiceInternalTrafficPolicyLocal)
	return spec
}

// itpLocalPodToPod: one backend on node A; a pod on node A reaches it through the cluster IP,
// a pod on node B gets an error every time.
func itpLocalPodToPod(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-itp", itpLocal(tcpService(corev1.ServiceTypeClusterIP, 80, 8080)))
	eps := []endpoint{podEndpoint(a, a.backend(), readyPod)}
	c.setSlice(t, svc, eps...)
	c.waitSynced(t, svc, eps...)
	for range 5 {
		expectHostname(t, a.client().NS, clusterIP(svc, 0), a.backend().Name)
		expectNoAnswer(t, b.client().NS, clusterIP(svc, 0), "internalTrafficPolicy=Local and no endpoint on node B")
	}
}

// itpLocalHostToPod: as itpLocalPodToPod with the clients on the host network (the node
// namespaces themselves), on service port 8000.
func itpLocalHostToPod(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-itp-hostnet-client", itpLocal(tcpService(corev1.ServiceTypeClusterIP, 8000, 8080)))
	eps := []endpoint{podEndpoint(a, a.backend(), readyPod)}
	c.setSlice(t, svc, eps...)
	c.waitSynced(t, svc, eps...)
	for range 5 {
		expectHostname(t, a.NS, clusterIP(svc, 0), a.backend().Name)
		expectNoAnswer(t, b.NS, clusterIP(svc, 0), "internalTrafficPolicy=Local and no endpoint on node B")
	}
}

// itpLocalToHostNetworkPod: the backend runs on node A's host network (port 10180, answering
// with the node name, as agnhost does there); pods and then the nodes themselves are clients.
func itpLocalToHostNetworkPod(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	const endpointPort = 10180
	ctx, cancel := context.WithCancel(context.Background())
	wait, err := (&testbed.Pod{NS: a.NS, Name: a.name, IP: a.IP}).Serve(ctx, endpointPort, endpointPort)
	if err != nil {
		cancel()
		t.Fatalf("host-network backend on %s: %v", a.name, err)
	}
	t.Cleanup(func() { cancel(); wait() })

	svc := c.service(t, "svc-itp-hostnet-backend", itpLocal(tcpService(corev1.ServiceTypeClusterIP, 80, endpointPort)))
	eps := []endpoint{{addr: a.IP, node: a, cond: readyPod}}
	c.setSlice(t, svc, eps...)
	c.waitSynced(t, svc, eps...)
	for range 5 {
		expectHostname(t, a.client().NS, clusterIP(svc, 0), a.name)
		expectNoAnswer(t, b.client().NS, clusterIP(svc, 0), "internalTrafficPolicy=Local and no endpoint on node B")
	}
	for range 5 {
		expectHostname(t, a.NS, clusterIP(svc, 0), a.name)
		expectNoAnswer(t, b.NS, clusterIP(svc, 0), "internalTrafficPolicy=Local and no endpoint on node B")
	}
}

// healthCheck is kube-proxy's answer on a service's healthCheckNodePort.
type healthCheck struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints int `json:"localEndpoints"`
}

// healthCheckOnlyTerminating: a LoadBalancer service with externalTrafficPolicy=Local and its
// one backend on node A. Node A's health check node port answers 200 while the backend is ready
// and 503 once it only terminates, and the node port still serves through it meanwhile.
func healthCheckOnlyTerminating(t *testing.T, c *twoNodes) {
	a := c.nodes[0]
	spec := tcpService(corev1.ServiceTypeLoadBalancer, 80, 8080)
	spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	svc := c.service(t, "svc-proxy-terminating-hc", spec)
	if svc.Spec.HealthCheckNodePort == 0 {
		t.Fatalf("service %s/%s: no healthCheckNodePort allocated", svc.Namespace, svc.Name)
	}
	hc := fmt.Sprintf("http://%s/healthz", netip.AddrPortFrom(a.IP, uint16(svc.Spec.HealthCheckNodePort)))
	// The upstream check: every second for a minute, from a pod on node A, with 5 s per request.
	expectHealth := func(wantCode, wantLocal int) {
		t.Helper()
		var last string
		err := testbed.Eventually(t.Context(), time.Minute, time.Second, func() error {
			code, body, err := httpGetTimeout(a.client().NS, hc, 5*time.Second)
			if err != nil {
				last = err.Error()
				return err
			}
			last = fmt.Sprintf("%d %s", code, body)
			if code != wantCode {
				return fmt.Errorf("GET %s = %s, want %d", hc, last, wantCode)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("health check node port of %s/%s: %v (last: %s)", svc.Namespace, svc.Name, err, last)
		}
		// Beyond upstream: the body is kube-proxy's JSON.
		var got healthCheck
		_, body, _ := httpGetTimeout(a.client().NS, hc, 5*time.Second)
		if err := json.Unmarshal([]byte(body), &got); err != nil {
			t.Fatalf("GET %s: body %q: %v", hc, body, err)
		}
		want := healthCheck{LocalEndpoints: wantLocal}
		want.Service.Namespace, want.Service.Name = svc.Namespace, svc.Name
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("GET %s body (-want +got):\n%s", hc, diff)
		}
	}

	ready := []endpoint{podEndpoint(a, a.backend(), readyPod)}
	c.setSlice(t, svc, ready...)
	c.waitSynced(t, svc, ready...)
	expectHealth(http.StatusOK, 1)

	terminating := []endpoint{podEndpoint(a, a.backend(), terminatingServingPod)}
	c.setSlice(t, svc, terminating...)
	c.waitSynced(t, svc, terminating...)
	expectHealth(http.StatusServiceUnavailable, 0)

	expectHostname(t, a.client().NS, nodePort(svc, a, 0), a.backend().Name)
}

// terminatingOnA creates svc's slice with its backend on node A ready, waits for both proxies,
// then marks the backend terminating but serving: what the controller writes when the pod is
// deleted with a long grace period and keeps passing its readiness probe.
func terminatingOnA(t *testing.T, c *twoNodes, svc *corev1.Service) {
	a := c.nodes[0]
	ready := []endpoint{podEndpoint(a, a.backend(), readyPod)}
	c.setSlice(t, svc, ready...)
	c.waitSynced(t, svc, ready...)
	terminating := []endpoint{podEndpoint(a, a.backend(), terminatingServingPod)}
	c.setSlice(t, svc, terminating...)
	c.waitSynced(t, svc, terminating...)
}

func fallbackITPCluster(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-proxy-terminating-itp-cluster", tcpService(corev1.ServiceTypeClusterIP, 80, 8080))
	terminatingOnA(t, c, svc)
	for range 5 {
		expectHostname(t, a.client().NS, clusterIP(svc, 0), a.backend().Name)
		expectHostname(t, b.client().NS, clusterIP(svc, 0), a.backend().Name)
	}
}

func fallbackITPLocal(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-proxy-terminating-itp-local", itpLocal(tcpService(corev1.ServiceTypeClusterIP, 80, 8080)))
	terminatingOnA(t, c, svc)
	for range 5 {
		expectHostname(t, a.client().NS, clusterIP(svc, 0), a.backend().Name)
		expectNoAnswer(t, b.client().NS, clusterIP(svc, 0), "internalTrafficPolicy=Local and the only endpoint is on node A")
	}
}

func fallbackETPCluster(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-proxy-terminating-etp-cluster", tcpService(corev1.ServiceTypeNodePort, 80, 8080))
	terminatingOnA(t, c, svc)
	for range 5 {
		expectHostname(t, a.client().NS, nodePort(svc, a, 0), a.backend().Name)
		expectHostname(t, b.client().NS, nodePort(svc, a, 0), a.backend().Name)
	}
}

// fallbackETPLocal: a pod on node A reaching node B's node port is external traffic to node B,
// which has no local endpoint; node A's node port serves its own terminating endpoint to pods of
// both nodes. (Upstream leaves out node B's pod to node B's node port: kube-proxy treats it as
// neither internal nor external.)
func fallbackETPLocal(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	spec := tcpService(corev1.ServiceTypeNodePort, 80, 8080)
	spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	svc := c.service(t, "svc-proxy-terminating-etp-local", spec)
	terminatingOnA(t, c, svc)
	for range 5 {
		expectNoAnswer(t, a.client().NS, nodePort(svc, b, 0), "externalTrafficPolicy=Local and no endpoint on node B")
		expectHostname(t, a.client().NS, nodePort(svc, a, 0), a.backend().Name)
		expectHostname(t, b.client().NS, nodePort(svc, a, 0), a.backend().Name)
	}
}

// rejectedNoEndpoints: a service without endpoints refuses connections (ECONNREFUSED, as
// `agnhost connect` reports REFUSED), polled every 2 s for up to 30 s, each try 3 s; a connection
// that is accepted fails at once. Beyond upstream, the UDP port answers with ICMP port
// unreachable (ECONNREFUSED on the connected socket).
func rejectedNoEndpoints(t *testing.T, c *twoNodes) {
	a := c.nodes[0]
	spec := tcpService(corev1.ServiceTypeClusterIP, 80, 8080)
	spec.Ports = append(spec.Ports, corev1.ServicePort{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(5353)})
	svc := c.service(t, "no-pods", spec)
	c.setSlice(t, svc) // the controller's slice for a service whose selector matches no pod
	c.waitSynced(t, svc)
	const tryTimeout = 3 * time.Second

	t.Run("TCP", func(t *testing.T) {
		expectRefused(t, func() (accepted bool, err error) {
			conn, err := testbed.Dial(a.client().NS, clusterIP(svc, 0), tryTimeout)
			if err == nil {
				conn.Close()
				return true, nil
			}
			return false, err
		})
	})
	t.Run("UDP", func(t *testing.T) {
		expectRefused(t, func() (answered bool, err error) {
			_, err = testbed.WhoUDP(a.client().NS, clusterIP(svc, 1), tryTimeout)
			return err == nil, err
		})
	})
}

// expectRefused polls try as upstream does until it reports ECONNREFUSED; a success fails t.
func expectRefused(t *testing.T, try func() (ok bool, err error)) {
	t.Helper()
	deadline := time.Now().Add(kubeProxyEndpointLagTimeout)
	for {
		ok, err := try()
		switch {
		case ok:
			t.Fatal("expected connect call to fail: the service has no endpoints")
		case errors.Is(err, syscall.ECONNREFUSED):
			return
		case time.Now().After(deadline):
			t.Fatalf("not refused within %v: %v", kubeProxyEndpointLagTimeout, err)
		}
		t.Logf("error is not ECONNREFUSED, keep trying: %v", err)
		select {
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		case <-time.After(upstreamPoll):
		}
	}
}

// publishNotReadyTrue: the backend on node A is deleted and its readiness fails; with
// publishNotReadyAddresses the EndpointSlice controller still publishes it ready
// (ready = publishNotReadyAddresses || (serving && !terminating)), with serving=false and
// terminating=true. A pod on node B reaches it through the cluster IP and both node ports.
func publishNotReadyTrue(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	spec := tcpService(corev1.ServiceTypeNodePort, 80, 8080)
	spec.PublishNotReadyAddresses = true
	svc := c.service(t, "svc-tolerate-unready", spec)
	ready := []endpoint{podEndpoint(a, a.backend(), readyPod)}
	c.setSlice(t, svc, ready...)
	c.waitSynced(t, svc, ready...)
	unready := []endpoint{podEndpoint(a, a.backend(), conditions{ready: true, serving: false, terminating: true})}
	c.setSlice(t, svc, unready...)
	c.waitSynced(t, svc, unready...)
	for range 5 {
		expectHostname(t, b.client().NS, clusterIP(svc, 0), a.backend().Name)
		expectHostname(t, b.client().NS, nodePort(svc, a, 0), a.backend().Name)
		expectHostname(t, b.client().NS, nodePort(svc, b, 0), a.backend().Name)
	}
}

// publishNotReadyFalse: the same without publishNotReadyAddresses: the controller publishes the
// deleted, unready pod with ready=false, serving=false, terminating=true, which no proxy may use.
func publishNotReadyFalse(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-not-tolerate-unready", tcpService(corev1.ServiceTypeNodePort, 80, 8080))
	ready := []endpoint{podEndpoint(a, a.backend(), readyPod)}
	c.setSlice(t, svc, ready...)
	c.waitSynced(t, svc, ready...)
	unready := []endpoint{podEndpoint(a, a.backend(), conditions{terminating: true})}
	c.setSlice(t, svc, unready...)
	c.waitSynced(t, svc, unready...)
	// Wait until the change has reached both nodes (upstream: every 2 s for 30 s).
	for _, n := range c.nodes {
		addr := nodePort(svc, n, 0)
		err := testbed.Eventually(t.Context(), kubeProxyEndpointLagTimeout, upstreamPoll, func() error {
			if who, err := testbed.Who(b.client().NS, addr, failConnectTimeout); err == nil {
				return fmt.Errorf("still answered by %s", who)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("node port %s of %s still serves the unready endpoint: %v", addr, n.name, err)
		}
	}
	for range 5 {
		expectNoAnswer(t, b.client().NS, clusterIP(svc, 0), "the only endpoint is unready and terminating")
		expectNoAnswer(t, b.client().NS, nodePort(svc, a, 0), "the only endpoint is unready and terminating")
		expectNoAnswer(t, b.client().NS, nodePort(svc, b, 0), "the only endpoint is unready and terminating")
	}
}

// topologyHints: one backend per zone, each hinted for its own zone, as the EndpointSlice
// controller writes for trafficDistribution: PreferClose (or the topology-mode: Auto annotation).
// Each node's pods reach only their zone's backend; once one endpoint lacks hints, a proxy
// must ignore hints altogether (kube-proxy's rule), and both backends answer from both nodes.
func topologyHints(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	spec := tcpService(corev1.ServiceTypeClusterIP, 80, 8080)
	spec.TrafficDistribution = ptr(corev1.ServiceTrafficDistributionPreferClose)
	svc := c.service(t, "svc-topology", spec)
	hinted := []endpoint{
		podEndpoint(a, a.backend(), readyPod, a.zone),
		podEndpoint(b, b.backend(), readyPod, b.zone),
	}
	c.setSlice(t, svc, hinted...)
	c.waitSynced(t, svc, hinted...)
	const n = 6
	// Clients on each node: its client pod and the node itself (host network).
	clientsOf := func(nd *node) []*netns.NS { return []*netns.NS{nd.client().NS, nd.NS} }
	for _, nd := range c.nodes {
		for _, from := range clientsOf(nd) {
			want := map[string]int{nd.backend().Name: n}
			if diff := cmp.Diff(want, tally(t, whoTCP, from, clusterIP(svc, 0), n)); diff != "" {
				t.Errorf("pods answering %s from %s in %s (-want +got):\n%s", clusterIP(svc, 0), from.Name, nd.zone, diff)
			}
		}
	}
	if t.Failed() {
		return
	}

	unhinted := []endpoint{hinted[0], podEndpoint(b, b.backend(), readyPod)}
	c.setSlice(t, svc, unhinted...)
	want := []string{a.backend().Name, b.backend().Name}
	for _, nd := range c.nodes {
		for _, from := range clientsOf(nd) {
			eventually(t, kubeProxyEndpointLagTimeout, fmt.Sprintf("%s never reached both zones after a hint was removed", from.Name), func() error {
				got := keys(tally(t, whoTCP, from, clusterIP(svc, 0), n))
				if !cmp.Equal(want, got) {
					return fmt.Errorf("pods answering (-want +got):\n%s", cmp.Diff(want, got))
				}
				return nil
			})
		}
	}
}

// httpGetTimeout is httpGet with its own overall timeout.
func httpGetTimeout(ns *netns.NS, url string, timeout time.Duration) (int, string, error) {
	client := nodeHTTP(ns)
	client.Timeout = timeout
	resp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	return resp.StatusCode, string(body), err
}

// sourceRanges is upstream's "should only allow access from service loadbalancer source ranges":
// a LoadBalancer Service whose loadBalancerSourceRanges admit one client pod is reachable at its
// load-balancer IP from that pod only; moving the range to the other pod moves the access; removing
// the ranges opens it to both. Each check polls every 2 s until it holds (upstream's
// checkReachabilityFromPod), bounded by the endpoint lag timeout.
func sourceRanges(t *testing.T, c *twoNodes) {
	a, b := c.nodes[0], c.nodes[1]
	lbIP := netip.MustParseAddr("10.96.250.1") // routed to each node from its pods; no cluster IP is allocated this high in the tests
	spec := tcpService(corev1.ServiceTypeLoadBalancer, 80, 8080)
	spec.LoadBalancerSourceRanges = []string{a.client().IP.String() + "/32"}
	svc := c.service(t, "svc-source-ranges", spec)
	c.setSlice(t, svc, podEndpoint(a, a.backend(), readyPod))
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbIP.String()}}
	api := c.admin.CoreV1().Services(svc.Namespace)
	svc, err := api.UpdateStatus(t.Context(), svc, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("load-balancer status of %s: %v", svc.Name, err)
	}
	lb := netip.AddrPortFrom(lbIP, 80)
	reach := func(from *testbed.Pod, want bool) {
		t.Helper()
		deadline := time.Now().Add(kubeProxyEndpointLagTimeout)
		for {
			_, err := testbed.Who(from.NS, lb, failConnectTimeout)
			if (err == nil) == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s -> %s: reachable=%v (%v), want reachable=%v within %v", from.Name, lb, err == nil, err, want, kubeProxyEndpointLagTimeout)
			}
			select {
			case <-t.Context().Done():
				t.Fatal(t.Context().Err())
			case <-time.After(upstreamPoll):
			}
		}
	}
	reach(a.client(), true)
	reach(b.client(), false)

	svc.Spec.LoadBalancerSourceRanges = []string{b.client().IP.String() + "/32"}
	if svc, err = api.Update(t.Context(), svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reach(b.client(), true)
	reach(a.client(), false)

	svc.Spec.LoadBalancerSourceRanges = nil
	if _, err = api.Update(t.Context(), svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reach(a.client(), true)
	reach(b.client(), true)
}
