package tcp

import (
	"io"
	"net"
	"net/netip"
	"runtime"
	"testing"
	"time"
)

// Benchmarks compare the proxy with a direct connection to the same loopback endpoint:
//
//	go test -run '^$' -bench . -benchtime 2s ./proxier/tcp/

func benchTargets(b *testing.B, handler func(*net.TCPConn)) map[string]string {
	ep := serve(b, "127.0.0.3", handler)
	p := benchProxy(b, ep, Config{})
	return map[string]string{"direct": ep.String(), "proxy": p.Addr().String()}
}

func benchProxy(b *testing.B, ep netip.AddrPort, cfg Config) *Proxy {
	cfg.Logger = testLogger(b)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, cfg)
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		b.Fatal(err)
	}
	go p.Run(b.Context())
	b.Cleanup(p.Shutdown)
	return p
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

// BenchmarkIdleMemory reports what the proxy's Go code holds per connection, from the runtime's own
// accounting, as the difference between benchConns connections through the proxy and benchConns
// direct ones (clients and endpoint live in this process too):
//   - heapB/idle-conn: live heap after a GC once every direction has parked;
//   - stackB/active-conn: goroutine stacks of connections that just exchanged a byte and have not
//     parked yet. A burst of new connections holds this much per connection for ParkAfter, and
//     the runtime returns the freed stack memory to the OS only slowly, so it drives the RSS per idle
//     connection that bench/suite measures after opening 9,000 in a burst.
func BenchmarkIdleMemory(b *testing.B) {
	const benchConns = 1000
	ep := serve(b, "127.0.0.3", echo)
	parking := benchProxy(b, ep, Config{ParkAfter: 10 * time.Millisecond})
	running := benchProxy(b, ep, Config{ParkAfter: time.Hour})

	// measure opens benchConns connections to addr, each with one byte echoed (the proxy has dialed
	// by then), waits until at most want goroutines run, and reads the memory statistics.
	measure := func(addr string, want func(base int) int) runtime.MemStats {
		base := runtime.NumGoroutine()
		conns := make([]net.Conn, 0, benchConns)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		buf := make([]byte, 1)
		for range benchConns {
			c, err := net.Dial("tcp4", addr)
			if err != nil {
				b.Fatal(err)
			}
			conns = append(conns, c)
			if _, err := c.Write(buf); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				b.Fatal(err)
			}
		}
		deadline := time.Now().Add(20 * time.Second)
		for runtime.NumGoroutine() > want(base) {
			if time.Now().After(deadline) {
				b.Fatalf("%d goroutines, want at most %d", runtime.NumGoroutine(), want(base))
			}
			time.Sleep(5 * time.Millisecond)
		}
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms
	}
	// Every connection has its endpoint handler goroutine; through the proxy, 2 more until parked.
	direct := func(base int) int { return base + benchConns + 2 }
	active := func(base int) int { return base + 3*benchConns + 2 }
	var heap, stack float64
	for b.Loop() {
		d := measure(ep.String(), direct)
		p := measure(parking.Addr().String(), direct)
		r := measure(running.Addr().String(), active)
		heap = float64(int64(p.HeapAlloc)-int64(d.HeapAlloc)) / benchConns
		stack = float64(int64(r.StackInuse)-int64(d.StackInuse)) / benchConns
	}
	b.ReportMetric(heap, "heapB/idle-conn")
	b.ReportMetric(stack, "stackB/active-conn")
}
