package cli

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// fakeProxy serves /debug/flows as the protocol says: NDJSON items, flushed after each line; a
// follow=1 request with hold stays open until the client goes. It answers every query with the
// same items (the filters are the server's business) and records what it was asked.
type fakeProxy struct {
	lines  [][]byte
	hold   bool
	status int // non-zero: answer this status and body instead
	body   string

	mu   sync.Mutex
	reqs []*http.Request
	sent chan struct{} // closed once the first response's items are written
	once sync.Once
}

func newFakeProxy(t *testing.T, items ...observe.Item) *fakeProxy {
	t.Helper()
	p := &fakeProxy{sent: make(chan struct{})}
	for _, it := range items {
		b, err := json.Marshal(it)
		if err != nil {
			t.Fatal(err)
		}
		p.lines = append(p.lines, b)
	}
	return p
}

func (p *fakeProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	p.reqs = append(p.reqs, r.Clone(r.Context()))
	p.mu.Unlock()
	if r.URL.Path != "/debug/flows" {
		http.NotFound(w, r)
		return
	}
	if p.status != 0 {
		http.Error(w, p.body, p.status)
		return
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	for _, l := range p.lines {
		_, _ = w.Write(append(l, '\n'))
		w.(http.Flusher).Flush()
	}
	p.once.Do(func() { close(p.sent) })
	if p.hold && r.URL.Query().Get("follow") == "1" {
		<-r.Context().Done()
	}
}

func (p *fakeProxy) requests() []*http.Request {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*http.Request(nil), p.reqs...)
}

// serveLocal runs p on 127.0.0.1 and returns its host:port (the --address).
func serveLocal(t *testing.T, p *fakeProxy) string {
	t.Helper()
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// serveNodes runs one fake proxy per node on the same port of distinct loopback addresses
// (127.0.0.2, 127.0.0.3, ...), as nodes run theirs on one --port. It returns the port.
func serveNodes(t *testing.T, ps ...*fakeProxy) int {
	t.Helper()
	return serveNodesTLS(t, nil, ps...)
}

// serveNodesTLS is serveNodes on https with cfg, when cfg is not nil.
func serveNodesTLS(t *testing.T, cfg *tls.Config, ps ...*fakeProxy) int {
	t.Helper()
	for try := 0; try < 20; try++ {
		var ls []net.Listener
		port := 0
		for i := range ps {
			l, err := net.Listen("tcp", net.JoinHostPort(nodeIP(i), strconv.Itoa(port)))
			if err != nil {
				break
			}
			port = l.Addr().(*net.TCPAddr).Port
			ls = append(ls, l)
		}
		if len(ls) < len(ps) {
			for _, l := range ls {
				l.Close()
			}
			continue
		}
		for i, p := range ps {
			srv := &httptest.Server{Listener: ls[i], Config: &http.Server{Handler: p}, TLS: cfg}
			if cfg != nil {
				srv.StartTLS()
			} else {
				srv.Start()
			}
			t.Cleanup(srv.Close)
		}
		return port
	}
	t.Fatalf("no port free on %d loopback addresses", len(ps))
	return 0
}

func nodeIP(i int) string { return fmt.Sprintf("127.0.0.%d", i+2) }

// node is a Node named name whose InternalIP is nodeIP(i) (behind an ExternalIP, to check the
// InternalIP is preferred).
func node(name string, i int) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: v1.NodeStatus{Addresses: []v1.NodeAddress{
		{Type: v1.NodeExternalIP, Address: "192.0.2.1"}, {Type: v1.NodeInternalIP, Address: nodeIP(i)},
	}}}
}

// writeKubeconfig writes a kubeconfig whose user has token; its server is never reached (the
// tests' clientset is a fake).
func writeKubeconfig(t *testing.T, token string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://127.0.0.1:1"}
	cfg.AuthInfos["u"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "c"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

func fakeClientset(nodes ...*v1.Node) func(*rest.Config) (kubernetes.Interface, error) {
	return func(*rest.Config) (kubernetes.Interface, error) {
		objs := make([]runtime.Object, len(nodes))
		for i, n := range nodes {
			objs[i] = n
		}
		return fake.NewClientset(objs...), nil
	}
}

// t0 is the sample flows' base time.
var t0 = time.Date(2026, 7, 1, 12, 0, 1, 234_000_000, time.UTC)

// at is t0 plus ms milliseconds.
func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

// webFlow is default/web's request from 10.244.1.7, served by web-5f7b9c-x2x9q on node-b.
func webFlow(node string, ms int) observe.Item {
	return observe.Item{Flow: &observe.Flow{
		Time: at(ms), ID: 41, Phase: "end", Verdict: "forwarded", Node: node,
		Namespace: "default", Service: "web", Port: "http", Protocol: "TCP", Path: "socket",
		Client: "10.244.1.7:43512", ServiceAddress: "10.96.0.10:80", Source: "10.244.1.1:51234",
		Endpoint: "10.244.2.9:8080", EndpointPod: "default/web-5f7b9c-x2x9q", EndpointNode: "node-b",
		Pick: &observe.Pick{Algorithm: "round-robin"}, DialAttempts: 1, ConnectMicros: 850, FirstByteMicros: 1200,
		DurationMicros: 12345, BytesToEndpoint: 78, BytesToClient: 1234, EndReason: "client-closed",
	}}
}

// refusedFlow: no endpoint, the client was reset.
func refusedFlow(node string, ms int) observe.Item {
	return observe.Item{Flow: &observe.Flow{
		Time: at(ms), ID: 42, Phase: "end", Verdict: "refused", Node: node,
		Namespace: "default", Service: "web", Port: "http", Protocol: "TCP", Path: "socket",
		Client: "10.244.1.7:43514", ClientPod: "default/curl", ServiceAddress: "10.96.0.10:80", EndReason: "no-endpoints",
	}}
}

// dialFailedFlow: three dials, all refused; picked by least connections, retried.
func dialFailedFlow(node string, ms int) observe.Item {
	return observe.Item{Flow: &observe.Flow{
		Time: at(ms), ID: 43, Phase: "end", Verdict: "dial-failed", Node: node,
		Namespace: "shop", Service: "api", Protocol: "TCP", Path: "socket",
		Client: "10.244.1.8:40000", ServiceAddress: "10.96.0.11:8080", Endpoint: "10.244.3.4:8080",
		EndpointPod: "shop/api-0", EndpointNode: "node-c",
		Pick: &observe.Pick{Algorithm: "least-connections", Why: []string{"retry"}}, DialAttempts: 3,
		DurationMicros: 3_004_500, EndReason: "dial-failed", Error: "dial tcp 10.244.3.4:8080: connect: connection refused",
	}}
}

func lostItem(node string, ms int, count uint64, reason string) observe.Item {
	return observe.Item{Lost: &observe.Lost{Time: at(ms), Node: node, Count: count, Reason: reason}}
}
