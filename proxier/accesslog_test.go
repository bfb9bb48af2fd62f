package proxier

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"

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
	for _, on := range []bool{false, true} {
		name := "access_log=off"
		cfg := tcp.Config{}
		if on {
			name = "access_log=on"
			log := logrus.New()
			log.SetOutput(io.Discard)
			log.SetFormatter(&logrus.JSONFormatter{})
			cfg.OnEnd = AccessLog{Log: log}.OnEnd(port)
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
