package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// newBed builds the test's namespaces (node, client, external host and pods backend pods, see
// internal/testbed for the address plan) with every pod serving TCP 8080 and UDP 5353, all
// removed when the test ends, also on failure.
func newBed(t *testing.T, pods int) *testbed.Bed {
	t.Helper()
	requireRoot(t)
	lab := netns.NewTestLab(t)
	bed, err := testbed.New(t.Context(), lab, pods)
	if err != nil {
		t.Fatalf("test namespaces: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var waits []func()
	t.Cleanup(func() {
		cancel()
		for _, w := range waits {
			w()
		}
	})
	for _, p := range bed.Pods {
		wait, err := p.Serve(ctx, 8080, 5353)
		if err != nil {
			t.Fatalf("backends: %v", err)
		}
		waits = append(waits, wait)
	}
	return bed
}

// clusterNode is a test's node: its namespaces, its Node object, a Kubernetes namespace for its
// Services and EndpointSlices, and a kubeconfig that reaches the API server from the node
// namespace as system:kube-proxy.
type clusterNode struct {
	bed *testbed.Bed
	// name is the Node object's name and the proxy's --hostname-override.
	name string
	// namespace holds the test's Services and EndpointSlices; it shares the name.
	namespace  string
	kubeconfig string
	dir        string
	admin      kubernetes.Interface
}

// newClusterNode sets up a node for t with pods backend pods. Every object it creates is deleted
// when t ends.
func newClusterNode(t *testing.T, pods int) *clusterNode {
	t.Helper()
	requireControlPlane(t)
	bed := newBed(t, pods)
	n := &clusterNode{bed: bed, name: uniqueName(t), dir: t.TempDir(), admin: adminClient(t)}
	n.namespace = n.name
	ctx := t.Context()

	if _, err := n.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: n.namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace %s: %v", n.namespace, err)
	}
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.name},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: testbed.NodeExtIP.String()},
			{Type: corev1.NodeHostName, Address: n.name},
		}},
	}
	if _, err := n.admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node %s: %v", n.name, err)
	}
	t.Cleanup(func() { n.deleteObjects(t) })

	server, err := url.Parse(controlPlane.Server)
	if err != nil {
		t.Fatal(err)
	}
	relay := startRelay(t, bed.Node, server.Host)
	n.kubeconfig = filepath.Join(n.dir, "kube-proxy.kubeconfig")
	if err := framework.WriteRelayedKubeconfig(controlPlane.ProxyKubeconfig, n.kubeconfig, "https://"+relay.Addr()); err != nil {
		t.Fatal(err)
	}
	return n
}

// startProxy runs the proxy on the node as system:kube-proxy.
func (n *clusterNode) startProxy(t *testing.T, extra ...string) *proxyProcess {
	t.Helper()
	return startProxy(t, n.bed.Node, n.dir, proxyArgs(append([]string{
		"--kubeconfig=" + n.kubeconfig, "--hostname-override=" + n.name}, extra...)...)...)
}

// deleteObjects removes the test's Services, EndpointSlices, Node and namespace (the namespace
// stays Terminating: no controller-manager runs, hence the explicit deletes), so other tests'
// proxies stop serving them.
func (n *clusterNode) deleteObjects(t *testing.T) {
	deleteTestObjects(t, n.admin, n.namespace, n.name)
}

// deleteTestObjects removes the Services and EndpointSlices of namespace, the Nodes named and the
// namespace itself. Each call is retried while the API server is away (the soak restarts it, and a
// test's cleanup may run during a restart another test caused), up to cleanupAPITimeout; an object
// already gone is fine.
func deleteTestObjects(t *testing.T, admin kubernetes.Interface, namespace string, nodes ...string) {
	ctx := context.Background()
	var svcs *corev1.ServiceList
	if err := retryAPI(func() (err error) {
		svcs, err = admin.CoreV1().Services(namespace).List(ctx, metav1.ListOptions{})
		return err
	}); err != nil {
		t.Errorf("cleanup: list services in %s: %v", namespace, err)
	} else {
		for _, s := range svcs.Items {
			if err := retryAPI(func() error { return admin.CoreV1().Services(namespace).Delete(ctx, s.Name, metav1.DeleteOptions{}) }); err != nil {
				t.Errorf("cleanup: delete service %s/%s: %v", namespace, s.Name, err)
			}
		}
	}
	if err := retryAPI(func() error {
		return admin.DiscoveryV1().EndpointSlices(namespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	}); err != nil {
		t.Errorf("cleanup: delete endpointslices in %s: %v", namespace, err)
	}
	for _, node := range nodes {
		if err := retryAPI(func() error { return admin.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{}) }); err != nil {
			t.Errorf("cleanup: delete node %s: %v", node, err)
		}
	}
	if err := retryAPI(func() error { return admin.CoreV1().Namespaces().Delete(ctx, namespace, metav1.DeleteOptions{}) }); err != nil {
		t.Errorf("cleanup: delete namespace %s: %v", namespace, err)
	}
}

// cleanupAPITimeout bounds how long a cleanup call waits for the API server to come back: the
// soak's API server and etcd restarts take a few seconds (its bound for them is 35 s).
const cleanupAPITimeout = 35 * time.Second

// retryAPI calls f until it succeeds, the object is gone (NotFound), it fails with an answer of
// the API server that a retry would get again, or cleanupAPITimeout passes. A broken connection,
// a 503 or a timeout while the API server restarts is retried.
func retryAPI(f func() error) error {
	deadline := time.Now().Add(cleanupAPITimeout)
	for {
		err := f()
		switch {
		case err == nil || apierrors.IsNotFound(err):
			return nil
		case time.Now().After(deadline):
			return err
		case apierrors.ReasonForError(err) != metav1.StatusReasonUnknown && !apierrors.IsServiceUnavailable(err) &&
			!apierrors.IsTimeout(err) && !apierrors.IsServerTimeout(err) && !apierrors.IsInternalError(err):
			return err // an answer: retrying would get the same
		}
		time.Sleep(200 * time.Millisecond) // waiting for the API server to come back: a retry pace, not synchronisation
	}
}

// adminClient is an admin client that does not log the API server's warnings (externalIPs are
// deprecated, and the tests use them on purpose).
func adminClient(t *testing.T) kubernetes.Interface {
	t.Helper()
	cfg := controlPlane.AdminConfig()
	cfg.WarningHandler = rest.NoWarnings{}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatalf("admin client: %v", err)
	}
	return c
}

// createService creates a Service in the node's namespace and returns it as stored (with its
// allocated cluster IP and node ports).
func (n *clusterNode) createService(t *testing.T, name string, spec corev1.ServiceSpec) *corev1.Service {
	t.Helper()
	return createService(t, n.admin, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.namespace}, Spec: spec})
}

// createService creates svc and returns it as stored.
func createService(t *testing.T, admin kubernetes.Interface, svc *corev1.Service) *corev1.Service {
	t.Helper()
	out, err := admin.CoreV1().Services(svc.Namespace).Create(t.Context(), svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create service %s/%s: %v", svc.Namespace, svc.Name, err)
	}
	return out
}

// setEndpoints makes svc's single EndpointSlice (what the endpoint slice controller would write)
// list the given pods (1-based, testbed.PodIP), with one slice port per service port.
func (n *clusterNode) setEndpoints(t *testing.T, svc *corev1.Service, pods ...int) {
	t.Helper()
	applySlice(t, n.admin, endpointSlice(svc, pods...))
}

// applySlice creates want, or replaces the slice of that name.
func applySlice(t *testing.T, admin kubernetes.Interface, want *discoveryv1.EndpointSlice) {
	t.Helper()
	api := admin.DiscoveryV1().EndpointSlices(want.Namespace)
	cur, err := api.Get(t.Context(), want.Name, metav1.GetOptions{})
	if err == nil {
		want.ResourceVersion = cur.ResourceVersion
		_, err = api.Update(t.Context(), want, metav1.UpdateOptions{})
	} else {
		_, err = api.Create(t.Context(), want, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatalf("endpointslice %s/%s: %v", want.Namespace, want.Name, err)
	}
}

// sliceOf is svc's single EndpointSlice (what the endpoint slice controller would write) with one
// slice port per service port, named like it, on its numeric target port, and no endpoints yet.
func sliceOf(svc *corev1.Service) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:      svc.Name + "-e2e",
			Namespace: svc.Namespace,
			Labels:    map[string]string{discoveryv1.LabelServiceName: svc.Name},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, p := range svc.Spec.Ports {
		s.Ports = append(s.Ports, discoveryv1.EndpointPort{
			Name: ptr(p.Name), Protocol: ptr(p.Protocol), Port: ptr(p.TargetPort.IntVal),
		})
	}
	return s
}

// endpointSlice is svc's slice listing the given pods (1-based, testbed.PodIP), all ready.
func endpointSlice(svc *corev1.Service, pods ...int) *discoveryv1.EndpointSlice {
	s := sliceOf(svc)
	for _, i := range pods {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{testbed.PodIP(i).String()},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)},
		})
	}
	return s
}

func ptr[T any](v T) *T { return &v }

var notDNS = regexp.MustCompile(`[^a-z0-9]+`)

// uniqueName is a DNS label derived from the test's name, unique across runs against one control
// plane: "kpp-<test>-<random>".
func uniqueName(t *testing.T) string {
	base := strings.Trim(notDNS.ReplaceAllString(strings.ToLower(strings.TrimPrefix(t.Name(), "Test")), "-"), "-")
	if len(base) > 40 {
		base = base[:40]
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	return "kpp-" + base + "-" + hex.EncodeToString(b[:])
}

var (
	externalIPMu   sync.Mutex
	nextExternalIP = 10
)

// externalIP hands each service its own address in testbed.ExternalRange: every proxy of the
// package sees every service, so two with the same external IP would collide in its rules.
func externalIP() string {
	externalIPMu.Lock()
	defer externalIPMu.Unlock()
	nextExternalIP++
	return fmt.Sprintf("203.0.113.%d", nextExternalIP)
}
