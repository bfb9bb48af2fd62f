package proxier

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
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
			cfg.OnClose = AccessLog{Log: log}.TCP(port)
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
	port := &service.Port{Name: service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}, AccessLog: true}
	al := AccessLog{Log: logger}
	client := netip.MustParseAddrPort("10.244.9.9:40000")
	ep := netip.MustParseAddrPort("10.244.1.10:8080")
	tcpReasons := map[tcp.EndReason]string{
		tcp.EndClientClosed: "client closed", tcp.EndEndpointClosed: "endpoint closed", tcp.EndClientReset: "client reset",
		tcp.EndEndpointReset: "endpoint reset", tcp.EndIdleTimeout: "idle timeout", tcp.EndDialFailed: "dial failed",
		tcp.EndNoEndpoints: "no endpoints", tcp.EndDrained: "drained", tcp.EndShutdown: "shutdown",
	}
	for reason, want := range tcpReasons {
		hook.Reset()
		al.TCP(port)(tcp.ConnInfo{Client: client, Endpoint: ep, BytesIn: 3, BytesOut: 7, End: reason, DialAttempts: 2})
		e := hook.LastEntry()
		if e == nil || e.Data["reason"] != want || e.Data["client"] != client.String() || e.Data["endpoint"] != ep.String() ||
			e.Data["bytes_to_endpoint"] != int64(3) || e.Data["bytes_to_client"] != int64(7) || e.Data["service"] != "ns/web:http" {
			t.Errorf("TCP %v: entry %+v, want reason %q with client, endpoint and bytes", reason, e, want)
		}
	}
	for _, reason := range []udp.EndReason{udp.EndIdle, udp.EndEvicted, udp.EndBackendRefused, udp.EndBackendError, udp.EndEndpointRemoved, udp.EndClosed} {
		hook.Reset()
		al.UDP(port)(udp.SessionInfo{Client: client, Endpoint: ep, PacketsToEndpoint: 1, BytesToEndpoint: 64, Reason: reason})
		e := hook.LastEntry()
		if e == nil || e.Data["reason"] != string(reason) || e.Data["bytes_to_endpoint"] != uint64(64) {
			t.Errorf("UDP %v: entry %+v", reason, e)
		}
	}
	hook.Reset()
	off := AccessLog{Log: logger}
	if off.TCP(&service.Port{}) != nil || (AccessLog{}).UDP(port) != nil {
		t.Error("access log hooks exist for a port that did not ask for them")
	}
}
