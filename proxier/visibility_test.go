package proxier

// Address plan: everything on 127.0.0.1 with kernel-chosen ports: echo backends, the proxy
// sockets (ListenIP 127.0.0.1) and the debug HTTP server. Portals are a fake; clients connect to
// the proxy port directly, as a portal rule would make them.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
)

var (
	echoTCP = testenv.EchoTCP
	echoUDP = testenv.EchoUDP
)

// realEnv is a proxier with real loopback sockets, a fake portal, an access log hook, a metrics
// registry and the debug HTTP server, serving ns/echo (TCP port "tcp", UDP port "udp").
type realEnv struct {
	p         *Proxier
	srv       *httptest.Server
	hook      *logtest.Hook
	reg       *prometheus.Registry
	proxyAddr map[string]string
	tcpEcho   netip.AddrPort
}

func newRealEnv(t *testing.T) *realEnv {
	t.Helper()
	e := &realEnv{tcpEcho: echoTCP(t), proxyAddr: map[string]string{}}
	udpBackend := echoUDP(t)
	logger, hook := logtest.NewNullLogger()
	logger.SetLevel(logrus.InfoLevel)
	e.hook = hook
	lb := loadbalancer.New(clock.RealClock{})
	portals := &recordingPortals{}
	p := New(Config{ListenIP: netip.MustParseAddr("127.0.0.1"), MinSyncPeriod: time.Second, SyncPeriod: time.Minute, Logger: logger},
		Deps{Balancer: lb, Portals: portals, Sockets: RealSockets(AccessLog{Log: logger}.SocketConfigs(SocketConfig{}))})
	e.p = p
	ctx, cancel := context.WithCancel(context.Background())
	p.paths.runCtx = ctx
	t.Cleanup(func() { cancel(); p.shutdown() })
	e.reg = prometheus.NewRegistry()
	e.reg.MustRegister(metrics.NewTrafficCollector(p))
	mux := http.NewServeMux()
	debugview.Register(mux, p)
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)

	p.OnServicesSynced()
	p.OnEndpointSlicesSynced()
	p.OnServiceAdd(makeService("ns", "echo", "10.96.0.7", func(s *v1.Service) {
		s.Annotations = map[string]string{AnnotationAccessLog: "true"}
	}, tcpPort("tcp", 80), udpPort("udp", 53)))
	p.OnEndpointSliceAdd(makeSlice("ns", "echo", "a", discovery.AddressTypeIPv4, []discovery.EndpointPort{
		slicePortOf("tcp", v1.ProtocolTCP, int32(e.tcpEcho.Port())), slicePortOf("udp", v1.ProtocolUDP, int32(udpBackend.Port())),
	}, sliceEP{addr: "127.0.0.1"}))
	if err := p.sync(ctx); err != nil {
		t.Fatal(err)
	}
	for _, s := range portals.specs {
		e.proxyAddr[s.Name.Port] = fmt.Sprintf("127.0.0.1:%d", s.ProxyPort)
	}
	return e
}

// openEcho opens a TCP connection through the proxy and checks one echo.
func (e *realEnv) openEcho(t *testing.T) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp4", e.proxyAddr["tcp"])
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("echo through the proxy = %q, %v", buf, err)
	}
	return c
}

func TestVisibilityWithRealSockets(t *testing.T) {
	e := newRealEnv(t)
	p, srv, hook, reg, tcpBackend, proxyAddr := e.p, e.srv, e.hook, e.reg, e.tcpEcho, e.proxyAddr
	ctx := context.Background()
	// A TCP connection stays open while we look at it.
	c := e.openEcho(t)
	client := c.LocalAddr().String()

	var conns []debugview.ConnView
	getJSON(t, srv.URL+"/debug/connections?service=ns/echo", &conns)
	if len(conns) != 1 || conns[0].Client != client || conns[0].Endpoint != tcpBackend.String() {
		t.Fatalf("/debug/connections = %+v, want one from %s to %s", conns, client, tcpBackend)
	}
	text := getText(t, srv.URL+"/debug/services")
	for _, want := range []string{"ns/echo:tcp", "10.96.0.7:80", tcpBackend.String() + "(ready)",
		"balancing: round-robin active[" + tcpBackend.String() + "=1]"} {
		if !strings.Contains(text, want) {
			t.Errorf("/debug/services text lacks %q:\n%s", want, text)
		}
	}

	// UDP: one exchange, then the counters and the session list.
	u, err := net.Dial("udp4", proxyAddr["udp"])
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	_ = u.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := u.Write([]byte("ping!!")); err != nil {
		t.Fatal(err)
	}
	if n, err := u.Read(make([]byte, 64)); err != nil || n != 6 {
		t.Fatalf("UDP reply: %d bytes, %v", n, err)
	}

	c.Close()
	testenv.WaitFor(t, "the TCP access log line", func() bool { return len(hook.AllEntries()) > 0 })
	entry := hook.AllEntries()[0]
	if entry.Data["access"] != "tcp" || entry.Data["client"] != client || entry.Data["reason"] != "client-closed" ||
		entry.Data["bytes_to_endpoint"] != uint64(5) || entry.Data["bytes_to_client"] != uint64(5) {
		t.Errorf("access log = %v %v, want tcp client closed 5/5 bytes from %s", entry.Message, entry.Data, client)
	}

	want := `
# HELP kube_portal_proxy_tcp_bytes_total Bytes proxied over TCP; direction is to_endpoint (client to pod) or to_client.
# TYPE kube_portal_proxy_tcp_bytes_total counter
kube_portal_proxy_tcp_bytes_total{direction="to_client",service_port="ns/echo:tcp"} 5
kube_portal_proxy_tcp_bytes_total{direction="to_endpoint",service_port="ns/echo:tcp"} 5
# HELP kube_portal_proxy_udp_packets_total Datagrams proxied; direction is to_endpoint or to_client.
# TYPE kube_portal_proxy_udp_packets_total counter
kube_portal_proxy_udp_packets_total{direction="to_client",service_port="ns/echo:udp"} 1
kube_portal_proxy_udp_packets_total{direction="to_endpoint",service_port="ns/echo:udp"} 1
`
	testenv.WaitFor(t, "tcp counters to settle", func() bool {
		return testutil.GatherAndCompare(reg, strings.NewReader(want), "kube_portal_proxy_tcp_bytes_total", "kube_portal_proxy_udp_packets_total") == nil
	})

	// Removed: nothing listed, no series left.
	p.OnServiceDelete(makeService("ns", "echo", "10.96.0.7", nil))
	if err := p.sync(ctx); err != nil {
		t.Fatal(err)
	}
	var svcs []debugview.ServiceView
	getJSON(t, srv.URL+"/debug/services", &svcs)
	getJSON(t, srv.URL+"/debug/connections", &conns)
	if len(svcs) != 0 || len(conns) != 0 {
		t.Errorf("after delete: services %+v, connections %+v, want none", svcs, conns)
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 0 {
		t.Errorf("after delete %d series remain (%v), want 0", n, err)
	}
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header.Set("Accept", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

func getText(t *testing.T, url string) string {
	t.Helper()
	_, body := testenv.Get(t, url)
	return body
}
