// Command tcp benchmarks the TCP proxy socket side by side with a direct connection, HAProxy and
// nginx stream, in one run on loopback only (not run in CI):
//
//	go run ./bench/tcp [-bulk-mib 512] [-dur 2s] [-conc 16] [-idle 9000] [-reps 1] [-only kpp,iouring,nginx]
//
// Targets besides direct, kpp, HAProxy and nginx: evloop (evloop.go) and iouring (bench/iouring,
// role iouring), two forwarder experiments, and -compare (another build, for A/B).
//
// Every proxy runs in its own process (ours is this binary re-executed with -role proxy) so its CPU
// time (utime+stime from /proc, summed over the process tree), RSS and descriptors can be read.
// Endpoints (an echo server and a sink) run in another child process on 127.0.0.2.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/rlimit"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

var (
	role       = flag.String("role", "bench", "bench | backend | proxy | evloop | iouring (internal)")
	echoEP     = flag.String("echo", "", "echo endpoint (role proxy)")
	sinkEP     = flag.String("sink", "", "sink endpoint (role proxy)")
	listenEcho = flag.String("listen-echo", "127.0.0.1:0", "where the proxy roles serve the echo endpoint (bench/suite -compare runs them in its node namespace)")
	listenSink = flag.String("listen-sink", "127.0.0.1:0", "where the proxy roles serve the sink endpoint")
	bulkMiB    = flag.Int("bulk-mib", 512, "bytes sent per bulk test, MiB")
	dur        = flag.Duration("dur", 2*time.Second, "duration of the rate tests")
	conc       = flag.Int("conc", 16, "concurrent clients in the rate tests")
	idleN      = flag.Int("idle", 9000, "idle connections held for the memory test")
	settle     = flag.Duration("settle", 5*time.Second, "wait after opening idle connections before measuring")
	only       = flag.String("only", "", "comma-separated targets (direct,kpp,kpp-uring,evloop,iouring,iouring-spare-p,haproxy,nginx,compare); empty = all")
	compare    = flag.String("compare", "", "another program to add as a target, run as: PROG [ARGS] -role proxy -echo ADDR -sink ADDR (an older build of this command for A/B, or a ceiling experiment; words after the first are its arguments, e.g. \"/tmp/benchtcp-old -engine io_uring\"; several programs separated by ';' are as many targets)")
	tests      = flag.String("tests", "bulk,conn,keepalive,idle", "the tests to run, comma-separated (a profile of one workload: -tests conn -dur 20s)")
	reps       = flag.Int("reps", 1, "repetitions over all targets, each starting one target later; the last table is the median")
	engine     = flag.String("engine", "epoll", "the TCP engine of role proxy: epoll, io_uring or auto (--io-engine)")
	nginxMod   = flag.String("nginx-module", "/usr/lib/nginx/modules/ngx_stream_module.so", "nginx stream module")
)

func main() {
	flag.Parse()
	var err error
	switch *role {
	case "backend":
		err = runBackend()
	case "proxy":
		err = runProxy()
	case "evloop":
		err = runEvloop()
	case "iouring":
		err = runIouring()
	default:
		err = runBench()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench/tcp:", err)
		os.Exit(1)
	}
}

// runBackend serves echo and sink on 127.0.0.2 and prints their addresses.
func runBackend() error {
	rlimit.RaiseNoFile(1 << 20)
	echoLn, err := net.Listen("tcp4", "127.0.0.2:0")
	if err != nil {
		return err
	}
	sinkLn, err := net.Listen("tcp4", "127.0.0.2:0")
	if err != nil {
		return err
	}
	fmt.Printf("echo %s\nsink %s\n", echoLn.Addr(), sinkLn.Addr())
	go acceptAll(sinkLn, func(c net.Conn) { io.Copy(io.Discard, c); c.Write([]byte{1}) })
	// Not io.Copy(c, c): between TCP sockets it splices through a pipe held while idle, 3 fds per
	// connection, and the backend would run out of descriptors before the idle test is done.
	go acceptAll(echoLn, func(c net.Conn) {
		buf := make([]byte, 4096)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				c.Write(buf[:n])
			}
			if err != nil {
				return
			}
		}
	})
	io.Copy(io.Discard, os.Stdin) // exit when the parent goes
	return nil
}

func acceptAll(ln net.Listener, h func(net.Conn)) {
	for {
		c, err := ln.Accept()
		if err != nil {
			time.Sleep(10 * time.Millisecond) // EMFILE in the benchmark backend: just retry
			continue
		}
		go func() { defer c.Close(); h(c) }()
	}
}

// runProxy runs our proxy for the echo and sink endpoints on 127.0.0.1.
func runProxy() error {
	if res, err := rlimit.RaiseNoFile(1 << 20); err != nil || res.Short() {
		fmt.Fprintln(os.Stderr, "warning:", res, err)
	}
	log := logrus.New()
	log.SetLevel(logrus.WarnLevel)
	eng, fallback, err := tcp.ChooseEngine(*engine, nil, nil)
	if err != nil {
		return err
	}
	if fallback != nil {
		fmt.Fprintln(os.Stderr, "warning: io_uring unavailable, epoll engine:", fallback)
	}
	defer eng.Close()
	for _, ep := range []struct{ name, addr, listen string }{{"echo", *echoEP, *listenEcho}, {"sink", *sinkEP, *listenSink}} {
		p := tcp.New(service.ServicePortName{Namespace: "bench", Name: ep.name},
			fixed(netip.MustParseAddrPort(ep.addr)), tcp.Config{Logger: log, Engine: eng})
		if err := p.Listen(netip.MustParseAddrPort(ep.listen)); err != nil {
			return err
		}
		go p.Run(context.Background())
		fmt.Printf("%s %s\n", ep.name, p.Addr())
	}
	io.Copy(io.Discard, os.Stdin)
	return nil
}

type fixed netip.AddrPort

func (f fixed) Next(netip.Addr, bool) (netip.AddrPort, error) { return netip.AddrPort(f), nil }

// target is one way to reach the endpoints.
type target struct {
	name       string
	echo, sink string
	pid        int // 0 for direct
	stop       func()
}

func runBench() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	backend, addrs, err := startChild(self, "-role", "backend")
	if err != nil {
		return fmt.Errorf("backend: %w", err)
	}
	defer backend()
	type starter struct {
		name  string
		start func() (target, error)
	}
	starters := []starter{
		{"direct", func() (target, error) {
			return target{name: "direct", echo: addrs["echo"], sink: addrs["sink"], stop: func() {}}, nil
		}},
		{"kpp", func() (target, error) { return startOwn(self, "proxy", "kpp", addrs) }},
		{"kpp-uring", func() (target, error) { return startOwn(self, "proxy", "kpp-uring", addrs, "-engine", "io_uring") }},
		{"evloop", func() (target, error) { return startOwn(self, "evloop", "evloop", addrs) }},
		{"iouring", func() (target, error) { return startOwn(self, "iouring", "iouring", addrs) }},
		{"iouring-spare-p", func() (target, error) {
			return startOwn(self, "iouring", "iouring-spare-p", addrs, "-iouring-spare-p")
		}},
		{"haproxy", func() (target, error) { return startHAProxy(addrs) }},
		{"nginx", func() (target, error) { return startNginx(addrs) }},
	}
	if *compare != "" {
		for i, cmd := range strings.Split(*compare, ";") {
			argv := strings.Fields(cmd)
			name := filepath.Base(argv[0])
			if i > 0 {
				name += fmt.Sprintf("#%d", i+1)
			}
			starters = append(starters, starter{"compare", func() (target, error) {
				return startOwn(argv[0], "proxy", name, addrs, argv[1:]...)
			}})
		}
	}
	var chosen []starter
	for _, s := range starters {
		if *only == "" || strings.Contains(","+*only+",", ","+s.name+",") {
			chosen = append(chosen, s)
		}
	}
	// Each repetition starts one target later than the previous one, so a drift in the machine's
	// load does not always fall on the same target; the table shows each figure's median.
	byTarget := map[string][]result{}
	var names []string
	for rep := range *reps {
		for i := range chosen {
			s := chosen[(i+rep)%len(chosen)]
			t, err := s.start()
			if err != nil {
				fmt.Fprintf(os.Stderr, "%s: %v (skipped)\n", s.name, err)
				continue
			}
			fmt.Fprintf(os.Stderr, "rep %d: running %s (pid %d)...\n", rep+1, t.name, t.pid)
			r, err := measure(t)
			t.stop()
			if err != nil {
				fmt.Fprintf(os.Stderr, "%s: %v\n", t.name, err)
			}
			if *reps > 1 {
				printTable([]result{r})
			}
			if _, ok := byTarget[r.name]; !ok {
				names = append(names, r.name)
			}
			byTarget[r.name] = append(byTarget[r.name], r)
		}
	}
	var rows []result
	for _, n := range names {
		rows = append(rows, medianResult(byTarget[n]))
	}
	if *reps > 1 {
		fmt.Printf("median of %d repetitions:\n", *reps)
	}
	printTable(rows)
	return nil
}

// medianResult is the median of every figure over rs, figure by figure.
func medianResult(rs []result) result {
	med := func(f func(r *result) *float64) float64 {
		v := make([]float64, len(rs))
		for i := range rs {
			v[i] = *f(&rs[i])
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	m := rs[0]
	for _, f := range []func(r *result) *float64{
		func(r *result) *float64 { return &r.gbps }, func(r *result) *float64 { return &r.cpuPerGB },
		func(r *result) *float64 { return &r.connRate }, func(r *result) *float64 { return &r.cpuPerConn },
		func(r *result) *float64 { return &r.reqRate }, func(r *result) *float64 { return &r.cpuPerReq },
		func(r *result) *float64 { return &r.rssPerConn }, func(r *result) *float64 { return &r.fdPerCon },
	} {
		*f(&m) = med(f)
	}
	return m
}

// startChild runs this binary in another role and reads "name addr" lines until the address count.
func startChild(self string, args ...string) (func(), map[string]string, error) {
	cmd := exec.Command(self, args...)
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	addrs := map[string]string{}
	sc := bufio.NewScanner(stdout)
	for len(addrs) < 2 && sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 {
			addrs[f[0]] = f[1]
		}
	}
	stop := func() { stdin.Close(); cmd.Wait() }
	if len(addrs) < 2 {
		stop()
		return nil, nil, fmt.Errorf("child %v reported %v", args, addrs)
	}
	return stop, addrs, nil
}

// startOwn runs a proxy child: this binary (or another build, -compare) in role (proxy:
// kube-portal-proxy's TCP proxy; evloop: the experiment in evloop.go).
func startOwn(self, role, name string, be map[string]string, extra ...string) (target, error) {
	cmd := exec.Command(self, append(extra, "-role", role, "-echo", be["echo"], "-sink", be["sink"])...)
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		return target{}, err
	}
	addrs := map[string]string{}
	sc := bufio.NewScanner(stdout)
	for len(addrs) < 2 && sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 {
			addrs[f[0]] = f[1]
		}
	}
	return target{name: name, echo: addrs["echo"], sink: addrs["sink"], pid: cmd.Process.Pid,
		stop: func() { stdin.Close(); cmd.Wait() }}, nil
}

func freePort() int {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return 0
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func startHAProxy(be map[string]string) (target, error) {
	dir, _ := os.MkdirTemp("", "bench-haproxy")
	pe, ps := freePort(), freePort()
	cfg := fmt.Sprintf(`global
  maxconn 9800
  nbthread 2
defaults
  mode tcp
  timeout connect 5s
  timeout client 1h
  timeout server 1h
frontend echo
  bind 127.0.0.1:%d
  default_backend echo
backend echo
  server e %s
frontend sink
  bind 127.0.0.1:%d
  default_backend sink
backend sink
  server s %s
`, pe, be["echo"], ps, be["sink"])
	path := filepath.Join(dir, "haproxy.cfg")
	os.WriteFile(path, []byte(cfg), 0o644)
	return startDaemon("haproxy", dir, pe, ps, "haproxy", "-db", "-f", path)
}

func startNginx(be map[string]string) (target, error) {
	dir, _ := os.MkdirTemp("", "bench-nginx")
	pe, ps := freePort(), freePort()
	cfg := fmt.Sprintf(`load_module %s;
daemon off;
worker_processes 2;
worker_rlimit_nofile 20000;
pid %s/nginx.pid;
error_log stderr warn;
events { worker_connections 19000; }
stream {
  server { listen 127.0.0.1:%d; proxy_pass %s; proxy_half_close on; }
  server { listen 127.0.0.1:%d; proxy_pass %s; proxy_half_close on; }
}
`, *nginxMod, dir, pe, be["echo"], ps, be["sink"])
	path := filepath.Join(dir, "nginx.conf")
	os.WriteFile(path, []byte(cfg), 0o644)
	return startDaemon("nginx", dir, pe, ps, "nginx", "-e", "stderr", "-p", dir, "-c", path)
}

func startDaemon(name, dir string, pe, ps int, argv ...string) (target, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return target{}, err
	}
	t := target{name: name, echo: fmt.Sprintf("127.0.0.1:%d", pe), sink: fmt.Sprintf("127.0.0.1:%d", ps),
		pid: cmd.Process.Pid, stop: func() {
			// SIGTERM: nginx's master stops its workers (SIGKILL would orphan them); haproxy exits.
			cmd.Process.Signal(syscall.SIGTERM)
			cmd.Wait()
			os.RemoveAll(dir)
		}}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if c, err := net.Dial("tcp4", t.echo); err == nil {
			c.Close()
			return t, nil
		}
	}
	t.stop()
	return target{}, fmt.Errorf("%s did not listen on %s", name, t.echo)
}

type result struct {
	name                 string
	gbps, cpuPerGB       float64
	connRate, cpuPerConn float64
	reqRate, cpuPerReq   float64
	rssPerConn, fdPerCon float64
	idleOK               int
}

func measure(t target) (result, error) {
	r := result{name: t.name}
	var err error
	run := func(test string) bool { return strings.Contains(","+*tests+",", ","+test+",") }
	if run("bulk") {
		cpu0 := cpuTime(t.pid)
		start := time.Now()
		n, err := bulk(t.sink, int64(*bulkMiB)<<20)
		if err != nil {
			return r, fmt.Errorf("bulk: %w", err)
		}
		el := time.Since(start).Seconds()
		r.gbps = float64(n) / el / 1e9
		r.cpuPerGB = (cpuTime(t.pid) - cpu0) / (float64(n) / 1e9)
	}
	if run("conn") {
		cpu0 := cpuTime(t.pid)
		cn := connRate(t.echo)
		r.connRate = float64(cn) / dur.Seconds()
		r.cpuPerConn = (cpuTime(t.pid) - cpu0) / float64(cn) * 1e6
	}
	if run("keepalive") {
		cpu0 := cpuTime(t.pid)
		rn := keepAlive(t.echo)
		r.reqRate = float64(rn) / dur.Seconds()
		r.cpuPerReq = (cpuTime(t.pid) - cpu0) / float64(rn) * 1e6
	}
	if !run("idle") {
		return r, nil
	}
	time.Sleep(time.Second) // let TIME_WAIT and goroutines of the rate tests settle
	rss0, fd0 := procstat.RSSKiB(t.pid), procstat.FDCount(t.pid)
	conns := openIdle(t.echo, *idleN)
	r.idleOK = len(conns)
	time.Sleep(*settle)
	if len(conns) > 0 {
		r.rssPerConn = float64(procstat.RSSKiB(t.pid)-rss0) / float64(len(conns))
		r.fdPerCon = float64(procstat.FDCount(t.pid)-fd0) / float64(len(conns))
	}
	for _, c := range conns {
		c.Close()
	}
	return r, err
}

func bulk(addr string, total int64) (int64, error) {
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	buf := make([]byte, 1<<20)
	var sent int64
	for sent < total {
		n, err := c.Write(buf)
		sent += int64(n)
		if err != nil {
			return sent, err
		}
	}
	c.(*net.TCPConn).CloseWrite()
	_, err = io.ReadFull(c, make([]byte, 1)) // the sink acks after EOF: every byte arrived
	return sent, err
}

// connRate: conc workers, each connecting from its own 127.0.0.x source to spread ephemeral ports,
// send 4 bytes, read them back, close.
func connRate(addr string) int64 {
	var total atomic.Int64
	deadline := time.Now().Add(*dur)
	var wg sync.WaitGroup
	for w := range *conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1, byte(10+w))}}
			buf := make([]byte, 4)
			for time.Now().Before(deadline) {
				c, err := d.Dial("tcp4", addr)
				if err != nil {
					continue
				}
				c.Write([]byte("ping"))
				if _, err := io.ReadFull(c, buf); err == nil {
					total.Add(1)
				}
				c.Close()
			}
		}()
	}
	wg.Wait()
	return total.Load()
}

func keepAlive(addr string) int64 {
	var total atomic.Int64
	deadline := time.Now().Add(*dur)
	var wg sync.WaitGroup
	for range *conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("tcp4", addr)
			if err != nil {
				return
			}
			defer c.Close()
			req, resp := make([]byte, 64), make([]byte, 64)
			n := int64(0)
			for time.Now().Before(deadline) {
				c.Write(req)
				if _, err := io.ReadFull(c, resp); err != nil {
					break
				}
				n++
			}
			total.Add(n)
		}()
	}
	wg.Wait()
	return total.Load()
}

func openIdle(addr string, n int) []net.Conn {
	var conns []net.Conn
	buf := make([]byte, 4)
	for i := range n {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 2, byte(1+i%200))}, Timeout: 2 * time.Second}
		c, err := d.Dial("tcp4", addr)
		if err != nil {
			fmt.Fprintf(os.Stderr, "idle conn %d: %v\n", i, err)
			break
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		c.Write([]byte("idle"))
		if _, err := io.ReadFull(c, buf); err != nil {
			fmt.Fprintf(os.Stderr, "idle conn %d: %v\n", i, err)
			c.Close()
			break
		}
		c.SetDeadline(time.Time{})
		conns = append(conns, c)
	}
	return conns
}

// cpuTime is utime+stime in seconds over the process tree.
func cpuTime(pid int) float64 { return procstat.CPUTime(pid).Seconds() }

func printTable(rows []result) {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "target\tbulk GB/s\tCPU s/GB\tconn/s\tCPU µs/conn\treq/s\tCPU µs/req\tidle conns\tKiB/idle conn\tfds/idle conn\t")
	for _, r := range rows {
		cpu := func(v float64) string {
			if r.name == "direct" {
				return "-"
			}
			return fmt.Sprintf("%.1f", v)
		}
		fmt.Fprintf(w, "%s\t%.2f\t%s\t%.0f\t%s\t%.0f\t%s\t%d\t%s\t%s\t\n", r.name, r.gbps, cpu(r.cpuPerGB),
			r.connRate, cpu(r.cpuPerConn), r.reqRate, cpu(r.cpuPerReq), r.idleOK, cpu(r.rssPerConn), cpu(r.fdPerCon))
	}
	w.Flush()
}
