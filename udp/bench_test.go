package udp

import (
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
)

// BenchmarkRoundTrip compares 64-byte request/response exchanges with an echo endpoint directly and
// through the proxy (the default loops, then one and two), from 8 concurrent clients per CPU.
// ns/op is per exchange across all clients.
//
//	go test -run '^$' -bench RoundTrip -benchtime 2s ./udp/
func BenchmarkRoundTrip(b *testing.B) {
	backend := benchEcho(b)
	quiet := logrus.New()
	quiet.SetLevel(logrus.WarnLevel)
	start := func(loops int) netip.AddrPort {
		p := New(testService, newFakePicker(backend), Config{Logger: quiet, Loops: loops})
		if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
			b.Fatal(err)
		}
		go p.Run(b.Context())
		b.Cleanup(func() { p.Close() })
		return p.Addr()
	}

	for _, target := range []struct {
		name string
		addr netip.AddrPort
	}{{"direct", backend}, {"proxy", start(0)}, {"proxy-1-loop", start(1)}, {"proxy-2-loops", start(2)}} {
		b.Run(target.name, func(b *testing.B) {
			b.SetParallelism(8)
			var lost atomic.Int64
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				conn, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(target.addr))
				if err != nil {
					b.Error(err)
					return
				}
				defer conn.Close()
				req, resp := make([]byte, 64), make([]byte, bufSize)
				conn.SetReadDeadline(time.Now().Add(time.Minute))
				for pb.Next() {
					if _, err := conn.Write(req); err != nil {
						b.Error(err)
						return
					}
					if _, err := conn.Read(resp); err != nil {
						lost.Add(1)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "exchanges/s")
			if n := lost.Load(); n > 0 {
				b.Errorf("%d clients lost a reply", n)
			}
		})
	}
}

func benchEcho(b *testing.B) netip.AddrPort {
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.2:0")))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { conn.Close() })
	for range 2 {
		go func() {
			buf := make([]byte, bufSize)
			for {
				n, from, err := conn.ReadFromUDPAddrPort(buf)
				if err != nil {
					return
				}
				conn.WriteToUDPAddrPort(buf[:n], from)
			}
		}()
	}
	return conn.LocalAddr().(*net.UDPAddr).AddrPort()
}
