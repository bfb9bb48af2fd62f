package tcp

import (
	"io"
	"net"
	"net/netip"
	"testing"
)

// Benchmarks compare the proxy with a direct connection to the same loopback endpoint:
//
//	go test -run '^$' -bench . -benchtime 2s ./proxier/tcp/

func benchTargets(b *testing.B, handler func(*net.TCPConn)) map[string]string {
	ep := serve(b, "127.0.0.3", handler)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Logger: testLogger(b)})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		b.Fatal(err)
	}
	go p.Run(b.Context())
	b.Cleanup(p.Shutdown)
	return map[string]string{"direct": ep.String(), "proxy": p.Addr().String()}
}

func BenchmarkBulkThroughput(b *testing.B) {
	targets := benchTargets(b, func(c *net.TCPConn) { io.Copy(io.Discard, c); c.Write([]byte{1}) })
	chunk := make([]byte, 1<<20)
	for _, name := range []string{"direct", "proxy"} {
		b.Run(name, func(b *testing.B) {
			c, err := net.Dial("tcp4", targets[name])
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			b.SetBytes(int64(len(chunk)))
			for b.Loop() {
				if _, err := c.Write(chunk); err != nil {
					b.Fatal(err)
				}
			}
			c.(*net.TCPConn).CloseWrite()
			io.ReadAll(c)
		})
	}
}

func BenchmarkConnRate(b *testing.B) {
	targets := benchTargets(b, echo)
	for _, name := range []string{"direct", "proxy"} {
		b.Run(name, func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				buf := make([]byte, 4)
				for pb.Next() {
					c, err := net.Dial("tcp4", targets[name])
					if err != nil {
						b.Error(err)
						return
					}
					c.Write([]byte("ping"))
					if _, err := io.ReadFull(c, buf); err != nil {
						b.Error(err)
					}
					c.Close()
				}
			})
		})
	}
}

func BenchmarkKeepAliveRequests(b *testing.B) {
	targets := benchTargets(b, echo)
	for _, name := range []string{"direct", "proxy"} {
		b.Run(name, func(b *testing.B) {
			b.SetParallelism(8)
			b.RunParallel(func(pb *testing.PB) {
				c, err := net.Dial("tcp4", targets[name])
				if err != nil {
					b.Error(err)
					return
				}
				defer c.Close()
				req, resp := make([]byte, 64), make([]byte, 64)
				for pb.Next() {
					c.Write(req)
					if _, err := io.ReadFull(c, resp); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
