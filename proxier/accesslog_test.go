package proxier

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

type onePicker struct{ ep netip.AddrPort }

func (p onePicker) Next(netip.Addr, bool) (netip.AddrPort, error) { return p.ep, nil }

// BenchmarkAccessLogCost measures what the access log costs per connection: a short connection
// (connect, 64-byte echo, close) through a real loopback proxy with the log off and on (a JSON
// logger writing to io.Discard, so only the proxy's own work is measured).
func BenchmarkAccessLogCost(b *testing.B) {
	backend := echoTCP(b)
	port := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "bench", Port: "tcp"}, Protocol: service.TCP, AccessLog: true}
	for _, mode := range []string{"off", "on", "on_with_pods"} {
		name := "access_log=" + mode
		cfg := tcp.Config{}
		if mode != "off" {
			log := logrus.New()
			log.SetOutput(io.Discard)
			log.SetFormatter(&logrus.JSONFormatter{})
			al := AccessLog{Log: log}
			if mode == "on_with_pods" { // the line names the pod behind the endpoint
				al.Pods = NewPodIndex()
				al.Pods.watch(port.Name)
				al.Pods.update(port.Name, []service.Endpoint{{Addr: backend, NodeName: "node-1",
					TargetRef: service.NamespacedName{Namespace: "ns", Name: "bench-0"}}})
			}
			cfg.OnEnd = al.OnEnd(port)
		}
		b.Run(name, func(b *testing.B) {
			p := tcp.New(port.Name, onePicker{backend}, cfg)
			if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			go p.Run(ctx)
			defer func() { cancel(); p.Shutdown() }()
			msg, buf := make([]byte, 64), make([]byte, 64)
			b.ReportAllocs()
			for b.Loop() {
				c, err := net.Dial("tcp4", p.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, buf); err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
		})
	}
}

// TestAccessLogLinePerEndReason: every way a connection or session ends gives one line that names
// the reason, with the client, endpoint and byte counts.
func TestAccessLogLinePerEndReason(t *testing.T) {
	logger, hook := logtest.NewNullLogger()
	tcpPort := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}, Protocol: service.TCP, AccessLog: true}
	udpPort := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web", Port: "dns"}, Protocol: service.UDP, AccessLog: true}
	al := AccessLog{Log: logger}
	client := netip.MustParseAddrPort("10.244.9.9:40000")
	ep := netip.MustParseAddrPort("10.244.1.10:8080")
	tcpReasons := map[flow.EndReason]string{
		flow.ClientClosed: "client-closed", flow.EndpointClosed: "endpoint-closed", flow.ClientReset: "client-reset",
		flow.EndpointReset: "endpoint-reset", flow.IdleTimeout: "idle-timeout", flow.DialFailed: "dial-failed",
		flow.NoEndpoints: "no-endpoints", flow.EndpointRemoved: "endpoint-removed", flow.Shutdown: "shutdown",
	}
	for reason, want := range tcpReasons {
		hook.Reset()
		al.OnEnd(tcpPort)(flow.Info{Client: client, Endpoint: ep, BytesToEndpoint: 3, BytesToClient: 7, End: reason, DialAttempts: 2})
		e := hook.LastEntry()
		if e == nil || e.Data["access"] != "tcp" || e.Data["reason"] != want || e.Data["client"] != client.String() || e.Data["endpoint"] != ep.String() ||
			e.Data["bytes_to_endpoint"] != uint64(3) || e.Data["bytes_to_client"] != uint64(7) || e.Data["service"] != "ns/web:http" {
			t.Errorf("TCP %v: entry %+v, want reason %q with client, endpoint and bytes", reason, e, want)
		}
	}
	udpReasons := map[flow.EndReason]string{
		flow.IdleTimeout: "idle-timeout", flow.Evicted: "evicted", flow.EndpointRefused: "endpoint-refused",
		flow.EndpointError: "endpoint-error", flow.EndpointRemoved: "endpoint-removed", flow.Shutdown: "shutdown",
	}
	for reason, want := range udpReasons {
		hook.Reset()
		al.OnEnd(udpPort)(flow.Info{Client: client, Endpoint: ep, PacketsToEndpoint: 1, BytesToEndpoint: 64, End: reason})
		e := hook.LastEntry()
		if e == nil || e.Data["access"] != "udp" || e.Data["reason"] != want || e.Data["bytes_to_endpoint"] != uint64(64) {
			t.Errorf("UDP %v: entry %+v, want reason %q", reason, e, want)
		}
	}
	hook.Reset()
	off := AccessLog{Log: logger}
	if off.OnEnd(&service.Port{}) != nil || (AccessLog{}).OnEnd(udpPort) != nil {
		t.Error("access log hooks exist for a port that did not ask for them")
	}
}

// TestAccessLogNamesThePod: a line names the pod (targetRef) and node behind its endpoint, also
// when the connection ends after the pod left the EndpointSlice (a drain); endpoints without a
// targetRef get no pod fields, and existing fields are unchanged.
func TestAccessLogNamesThePod(t *testing.T) {
	logger, hook := logtest.NewNullLogger()
	e := newFakeEnv(t, nil)
	pods := NewPodIndex()
	e.p = New(e.p.cfg, Deps{Balancer: e.lb, Portals: e.portals, Pods: pods, Sockets: e.p.deps.Sockets})
	e.synced()
	e.p.OnServiceAdd(webService(nil))
	slice := webSlice("web-1", 8080, "10.0.0.1", "10.0.0.2", "10.0.0.3")
	slice.Endpoints[0].TargetRef = &v1.ObjectReference{Kind: "Pod", Name: "web-a"}
	slice.Endpoints[0].NodeName = ptr("node-1")
	slice.Endpoints[1].TargetRef = &v1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "web-b"}
	e.p.OnEndpointSliceAdd(slice)
	port := &service.Port{Name: webHTTP, Protocol: service.TCP, AccessLog: true}
	end := AccessLog{Log: logger, Pods: pods}.OnEnd(port) // the socket is built: the port is watched
	client := netip.MustParseAddrPort("10.244.9.9:40000")
	line := func(ep string) logrus.Fields {
		hook.Reset()
		end(flow.Info{Client: client, Endpoint: netip.MustParseAddrPort(ep), End: flow.ClientClosed})
		return hook.LastEntry().Data
	}
	if f := line("10.0.0.1:8080"); f["pod"] != "ns/web-a" || f["node"] != "node-1" || f["endpoint"] != "10.0.0.1:8080" || f["reason"] != "client-closed" {
		t.Errorf("line for web-a: %v, want pod ns/web-a node node-1", f)
	}
	if f := line("10.0.0.2:8080"); f["pod"] != "ns/web-b" || f["node"] != "none" {
		t.Errorf("line for web-b: %v, want pod ns/web-b node none", f)
	}
	if f := line("10.0.0.3:8080"); f["pod"] != nil || f["node"] != nil {
		t.Errorf("line for an endpoint without targetRef: %v, want no pod fields", f)
	}
	// web-a's pod is deleted while its connection drains: the line still names it.
	e.p.OnEndpointSliceUpdate(nil, webSlice("web-1", 8080, "10.0.0.2", "10.0.0.3"))
	if f := line("10.0.0.1:8080"); f["pod"] != "ns/web-a" {
		t.Errorf("line after the pod left: %v, want pod ns/web-a", f)
	}
	// A port whose access log is off is not kept.
	pods.mu.RLock()
	n := len(pods.ports)
	pods.mu.RUnlock()
	if n != 1 {
		t.Errorf("index keeps %d ports, want 1 (only the one with its access log on)", n)
	}
}
