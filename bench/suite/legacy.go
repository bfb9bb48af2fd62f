package main

// legacy.go is the target kube-portal-proxy replaces: the real userspace kube-proxy of Kubernetes
// v1.25 (hack/legacy-build.sh builds it), run with --proxy-mode=userspace in the node namespace.
// Unlike the daemon it has no services file: it watches an API server. One control plane (etcd +
// kube-apiserver, e2e/framework) serves the whole run, holding the suite's Services and their
// core/v1 Endpoints - v1.25's userspace mode reads Endpoints, not EndpointSlices
// (cmd/kube-proxy/app/server_others.go sets UseEndpointSlices = false for it). Each bed gets its
// own relay from the node namespace's loopback to the API server.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/rest"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// legacyNode is the node the legacy proxy says it runs on (--hostname-override).
const legacyNode = "bench-node"

// legacyAPI is the run's control plane, started by the first legacy measurement.
type legacyAPI struct {
	mu  sync.Mutex
	cp  *framework.ControlPlane
	err error
}

// get starts the control plane and creates the suite's objects, once; a failure is remembered.
func (l *legacyAPI) get(ctx context.Context) (*framework.ControlPlane, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cp != nil || l.err != nil {
		return l.cp, l.err
	}
	// Creating core/v1 Endpoints is deliberate; the API server's deprecation warning is not news.
	rest.SetDefaultWarningHandler(rest.NoWarnings{})
	startCtx, cancel := context.WithTimeout(ctx, framework.DefaultStartTimeout)
	defer cancel()
	cp, err := framework.Start(startCtx, framework.Options{})
	if err != nil {
		l.err = fmt.Errorf("control plane: %w", err)
		return nil, l.err
	}
	if err := createLegacyObjects(startCtx, cp); err != nil {
		l.err = errors.Join(err, cp.Stop())
		return nil, l.err
	}
	l.cp = cp
	return cp, nil
}

func (l *legacyAPI) close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cp == nil {
		return nil
	}
	return l.cp.Stop()
}

// legacyService is one of the suite's services as API objects see it.
type legacyService struct {
	name     string
	vip      netip.AddrPort
	proto    corev1.Protocol
	podPort  uint16
	portName string
}

var legacyServices = []legacyService{
	{"echo", echoVIP, corev1.ProtocolTCP, echoPort, "tcp"},
	{"sink", sinkVIP, corev1.ProtocolTCP, sinkPort, "tcp"},
	{"dns", dnsVIP, corev1.ProtocolUDP, udpPort, "udp"},
	{"redis", redisVIP, corev1.ProtocolTCP, redisPort, "redis"},
	{"unbound", realDNSIP, corev1.ProtocolUDP, dnsPort, "dns"},
}

// createLegacyObjects creates the namespace, the node and, for each service, a selectorless
// Service with its fixed cluster IP and an Endpoints object naming the pod (no controller runs).
func createLegacyObjects(ctx context.Context, cp *framework.ControlPlane) error {
	c := cp.AdminClient()
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}},
		metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("namespace bench: %w", err)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: legacyNode},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: testbed.NodeClientIP.String()}}}}
	if _, err := c.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("node %s: %w", legacyNode, err)
	}
	for _, s := range legacyServices {
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: s.name, Namespace: "bench"},
			Spec: corev1.ServiceSpec{ClusterIP: s.vip.Addr().String(), Ports: []corev1.ServicePort{{
				Name: s.portName, Protocol: s.proto, Port: int32(s.vip.Port()), TargetPort: intstr.FromInt32(int32(s.podPort))}}},
		}
		if _, err := c.CoreV1().Services("bench").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("service bench/%s: %w", s.name, err)
		}
		//nolint:staticcheck // core/v1 Endpoints on purpose: the legacy proxy reads nothing else.
		ep := &corev1.Endpoints{
			ObjectMeta: metav1.ObjectMeta{Name: s.name, Namespace: "bench"},
			Subsets: []corev1.EndpointSubset{{
				Addresses: []corev1.EndpointAddress{{IP: testbed.PodIP(1).String()}},
				Ports:     []corev1.EndpointPort{{Name: s.portName, Protocol: s.proto, Port: int32(s.podPort)}},
			}},
		}
		if _, err := c.CoreV1().Endpoints("bench").Create(ctx, ep, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("endpoints bench/%s: %w", s.name, err)
		}
	}
	return nil
}

// legacyTarget runs the legacy kube-proxy binary in userspace mode against api.
func legacyTarget(binary string, api *legacyAPI) target {
	return target{name: "legacy v1.25", start: func(ctx context.Context, b *bed) (*running, error) {
		cp, err := api.get(ctx)
		if err != nil {
			return nil, err
		}
		server, err := url.Parse(cp.Server)
		if err != nil {
			return nil, err
		}
		rl, err := framework.StartRelay(b.tb.Node, server.Host)
		if err != nil {
			return nil, fmt.Errorf("API relay: %w", err)
		}
		kubeconfig := filepath.Join(b.dir, "kube-proxy.kubeconfig")
		if err := framework.WriteRelayedKubeconfig(cp.ProxyKubeconfig, kubeconfig, "https://"+rl.Addr()); err != nil {
			rl.Close()
			return nil, err
		}
		logPath := filepath.Join(b.dir, "legacy.log")
		log, err := os.Create(logPath)
		if err != nil {
			rl.Close()
			return nil, err
		}
		defer log.Close()
		proc, err := startChild(ctx, b.tb.Node, "kube-proxy", log, append([]string{binary}, legacyArgs(kubeconfig)...)...)
		if err != nil {
			rl.Close()
			return nil, err
		}
		r := &running{echo: echoVIP, sink: sinkVIP, udp: dnsVIP, redis: redisVIP, dns: realDNSIP, pid: proc.pid(), proc: proc,
			stopSig: syscall.SIGTERM, cleanup: rl.Close, idleMax: legacyIdleMax()}
		if err := waitReady(ctx, b, r); err != nil {
			r.stop()
			tail, _ := os.ReadFile(logPath)
			return nil, fmt.Errorf("%w; log:\n%s", err, lastLines(string(tail), 10))
		}
		return r, nil
	}}
}

// legacyFDsPerConn is what the legacy proxy holds per proxied TCP connection: both sockets and,
// because its io.Copy between two TCP connections splices, a pipe (2 descriptors) per direction
// for the connection's life - 6, measured.
const legacyFDsPerConn = 6

// legacyIdleMax is the most idle connections the legacy proxy holds within its descriptor limit
// (64,000, or the hard limit when it may not raise it): at the limit its accept loop panics
// ("Accept failed: ... too many open files") and the process exits.
func legacyIdleMax() int {
	hard, err := fdHardLimit()
	if err != nil {
		return 0
	}
	return (int(min(hard, 64000)) - fdHeadroom) / legacyFDsPerConn
}

// legacyArgs are the legacy proxy's flags: userspace mode as its users ran it, except that it
// leaves the conntrack sysctls alone (they are not the bed's to set) and keeps its OOM score.
// Its health and metrics servers listen on the node namespace's loopback. --bind-address: with
// the default 0.0.0.0 the userspace proxier picks the host address from the default route, and
// the node namespace has none (it refuses to start); its portal listeners then bind the node
// address, where REDIRECT sends the client's packets anyway.
func legacyArgs(kubeconfig string) []string {
	return []string{
		"--proxy-mode=userspace",
		"--kubeconfig=" + kubeconfig,
		"--hostname-override=" + legacyNode,
		"--bind-address=" + testbed.NodeClientIP.String(),
		"--healthz-bind-address=127.0.0.1:10256",
		"--metrics-bind-address=127.0.0.1:10249",
		"--conntrack-max-per-core=0",
		"--conntrack-min=0",
		"--conntrack-tcp-timeout-established=0",
		"--conntrack-tcp-timeout-close-wait=0",
		"--oom-score-adj=0",
		"--v=0",
	}
}

// legacyBinary is the default -legacy path: the cache hack/legacy-build.sh fills.
func legacyBinary() string {
	dir := os.Getenv("KPP_CACHE")
	if dir == "" {
		home, _ := os.UserHomeDir()
		dir = filepath.Join(home, ".cache", "kube-portal-proxy")
	}
	return filepath.Join(dir, "bin", "kube-proxy-v1.25.16")
}

// legacySkip says why the legacy target cannot run here ("" when it can).
func legacySkip(binary string) string {
	if _, err := os.Stat(binary); err != nil {
		return fmt.Sprintf("%v (run hack/legacy-build.sh)", err)
	}
	if _, err := framework.FindBinaries(); err != nil {
		return err.Error()
	}
	return available("iptables")
}
