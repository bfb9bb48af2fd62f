package tcp

import (
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
)

// Benchmarks compare the proxy on each engine with a direct connection to the same loopback
// endpoint, side by side in one run:
//
//	go test -run '^$' -bench . -benchtime 2s ./tcp/

// benchNames are the targets of every benchmark: direct, then the proxy on each engine.
var benchNames = []string{"direct", EngineEpoll, EngineIOUring}

func benchTargets(b *testing.B, handler func(*net.TCPConn)) map[string]string {
	return benchTargetsWith(b, handler, Config{})
}

// benchTargetsWith is benchTargets with proxies configured as cfg (its Engine set for each).
func benchTargetsWith(b *testing.B, handler func(*net.TCPConn), cfg Config) map[string]string {
	ep := serve(b, "127.0.0.3", handler)
	t := map[string]string{"direct": ep.String()}
	for _, e := range benchEngines(b) {
		cfg.Engine = e
		t[e.Name()] = benchProxy(b, ep, cfg).Addr().String()
	}
	return t
}

// benchEngines returns an engine of each kind (io_uring only where it is available), closed when
// the benchmark ends.
func benchEngines(b *testing.B) []Engine {
	engines := []Engine{Epoll}
	if err := ProbeIOUring(); err == nil {
		e := NewIOUring(0)
		b.Cleanup(func() { e.Close() }) // registered before the proxies': runs after their Shutdown
		engines = append(engines, e)
	}
	return engines
}

// benchRun runs f as a sub-benchmark for each target that exists.
func benchRun(b *testing.B, targets map[string]string, f func(b *testing.B, addr string)) {
	for _, name := range benchNames {
		if addr, ok := targets[name]; ok {
			b.Run(name, func(b *testing.B) { f(b, addr) })
		}
	}
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
	benchRun(b, targets, func(b *testing.B, addr string) {
		c, err := net.Dial("tcp4", addr)
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

func BenchmarkConnRate(b *testing.B) {
	benchConnRate(b, benchTargets(b, echo))
}

// BenchmarkConnRateRecording is BenchmarkConnRate with Config.Flows set to a recorder that
// copies each event: the cost of the live flow stream per new connection.
func BenchmarkConnRateRecording(b *testing.B) {
	benchConnRate(b, benchTargetsWith(b, echo, Config{Flows: &copyRecorder{}}))
}

func benchConnRate(b *testing.B, targets map[string]string) {
	benchRun(b, targets, func(b *testing.B, addr string) {
		defer reportCPU(b)()
		b.RunParallel(func(pb *testing.PB) {
			buf := make([]byte, 4)
			for pb.Next() {
				c, err := net.Dial("tcp4", addr)
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

func BenchmarkKeepAliveRequests(b *testing.B) {
	benchKeepAlive(b, benchTargets(b, echo))
}

// BenchmarkKeepAliveRequestsRecording is BenchmarkKeepAliveRequests with Config.Flows set.
func BenchmarkKeepAliveRequestsRecording(b *testing.B) {
	benchKeepAlive(b, benchTargetsWith(b, echo, Config{Flows: &copyRecorder{}}))
}

func benchKeepAlive(b *testing.B, targets map[string]string) {
	benchRun(b, targets, func(b *testing.B, addr string) {
		defer reportCPU(b)()
		b.SetParallelism(8)
		b.RunParallel(func(pb *testing.PB) {
			c, err := net.Dial("tcp4", addr)
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

// BenchmarkIdleMemory reports the live Go heap a parked idle connection holds in the proxy: heap in
// use after a GC with benchConns connections open through the proxy, minus the same with benchConns
// direct ones (clients and endpoint live in this process too). (Goroutine stacks are not reported:
// the runtime's StackInuse keeps stacks freed by exited goroutines in its caches across GCs, so it
// said 4-8 KiB per active connection from run to run for the same code. The RSS that bench/suite
// reads at 9,000 idle connections is the end-to-end figure.)
func BenchmarkIdleMemory(b *testing.B) {
	const benchConns = 1000
	ep := serve(b, "127.0.0.3", echo)

	// heapWith opens benchConns connections to addr, each with one byte echoed (the proxy has
	// dialed by then), waits until only the endpoint's handler goroutines are left (one per
	// connection: every direction has parked), and returns the live heap.
	heapWith := func(addr string) uint64 {
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
		want := base + benchConns + 2
		deadline := time.Now().Add(20 * time.Second)
		for runtime.NumGoroutine() > want {
			if time.Now().After(deadline) {
				b.Fatalf("%d goroutines, want at most %d: directions did not park", runtime.NumGoroutine(), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	for _, e := range benchEngines(b) {
		p := benchProxy(b, ep, Config{ParkAfter: 10 * time.Millisecond, Engine: e})
		b.Run(e.Name(), func(b *testing.B) {
			var heap float64
			for b.Loop() {
				direct := heapWith(ep.String())
				proxied := heapWith(p.Addr().String())
				heap = float64(int64(proxied)-int64(direct)) / benchConns
			}
			b.ReportMetric(heap, "heapB/idle-conn")
		})
	}
}

// BenchmarkDial compares the dial the proxy used before (package net, a timeout, a cancellable
// context) with dialSock, to the same loopback endpoint. The endpoint closes first and the dialer
// waits for that EOF: if the dialer closed first, its TIME_WAIT sockets would fill the ephemeral
// port range and connect's port search would dominate, more so for whichever dial is faster.
//
// cpu-ns/op is the whole process's CPU time per iteration, the endpoint's accept and close
// included. What this single-client loop shows: dialSock allocates a third as much, but spends as
// much or more CPU per dial, in the runtime scheduler (futex wake-ups of the second P, which
// package net's context goroutine keeps busy here). Under concurrent load that effect goes away:
// bench/suite's proxy CPU per connection fell by a fifth with dialSock and accept4 (git log).
func BenchmarkDial(b *testing.B) {
	ep := serve(b, "127.0.0.3", func(*net.TCPConn) {})
	buf := make([]byte, 1)
	b.Run("net.Dialer", func(b *testing.B) {
		defer reportCPU(b)()
		for b.Loop() {
			d := net.Dialer{Deadline: time.Now().Add(time.Second), KeepAlive: DefaultKeepAlive}
			c, err := d.DialContext(b.Context(), "tcp", ep.String())
			if err != nil {
				b.Fatal(err)
			}
			if _, err := c.Read(buf); err != io.EOF {
				b.Fatalf("read: %v, want EOF", err)
			}
			c.Close()
		}
	})
	b.Run("dialSock", func(b *testing.B) {
		defer reportCPU(b)()
		for b.Loop() {
			s, err := dialSock(ep, netip.AddrPort{}, time.Now().Add(time.Second), DefaultKeepAlive, noAbort{})
			if err != nil {
				b.Fatal(err)
			}
			if _, err := s.f.Read(buf); err != io.EOF {
				b.Fatalf("read: %v, want EOF", err)
			}
			s.close()
		}
	})
}

// reportCPU reports the process's CPU time (user+system) per iteration from the call until the
// returned function runs.
func reportCPU(b *testing.B) func() {
	start := procstat.CPUTime(os.Getpid())
	return func() {
		b.ReportMetric(float64(procstat.CPUTime(os.Getpid())-start)/float64(b.N), "cpu-ns/op")
	}
}

type noAbort struct{}

func (noAbort) startDial(*sock) bool { return true }
func (noAbort) endDial()             {}

// BenchmarkConnRateTransparent is BenchmarkConnRate on each engine with Config.Source nil and
// saying transparent, side by side: the cost of the transparent dial (IP_TRANSPARENT,
// SO_REUSEADDR and bind before the connect) per new connection. On loopback the client's
// address is local, so no reply steering is needed; the clients bind with SO_REUSEADDR so the
// proxy's bind can share their port (the fallbacks metric counts those that could not).
func BenchmarkConnRateTransparent(b *testing.B) {
	ep := serve(b, "127.0.0.3", echo)
	// Clients bind before the connect: a port that connect() took for itself cannot be shared
	// by a later bind (EADDRINUSE), reuse or not. Each takes the next port of a range, so the
	// bind does not search (a bind to port 0 would, and that search dominated the profile).
	// Every run of a sub-benchmark takes a client address of its own, 127.0.1.k, so no
	// connection meets one of an earlier run in TIME_WAIT.
	var next atomic.Uint32
	var host atomic.Uint32
	dial := func(addr string) (net.Conn, error) {
		port := 20000 + next.Add(1)%40000
		h := host.Load()
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, byte(1+h/250), byte(1+h%250)), Port: int(port)}, Control: func(_, _ string, c syscall.RawConn) error {
			var err error
			c.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
			return err
		}}
		return d.Dial("tcp4", addr)
	}
	for _, e := range benchEngines(b) {
		for _, tc := range []struct {
			name   string
			source flow.SourcePolicy
		}{{"nil", nil}, {"transparent", alwaysTransparent{}}} {
			p := benchProxy(b, ep, Config{Engine: e, Source: tc.source})
			b.Run(e.Name()+"/"+tc.name, func(b *testing.B) {
				host.Add(1)
				next.Store(0)
				defer reportCPU(b)()
				b.RunParallel(func(pb *testing.PB) {
					buf := make([]byte, 4)
					for pb.Next() {
						c, err := dial(p.Addr().String())
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
				st := p.Stats()
				b.ReportMetric(float64(st.TransparentFallbacks), "fallbacks")
				b.ReportMetric(float64(st.TransparentDials), "transparent-dials")
			})
		}
	}
}
