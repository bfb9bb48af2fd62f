package proxier

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
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
