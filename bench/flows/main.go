// Command flows measures what the live flow stream (issue #36) costs the data path, side by side
// with a build from before it, in one run (needs root; not run in CI):
//
//	make build && git worktree add /tmp/kpp-old 44a0773 && make -C /tmp/kpp-old build
//	sudo go run ./bench/flows -new bin/kube-portal-proxy -old /tmp/kpp-old/bin/kube-portal-proxy -rounds 5 -dur 5s
//
// Targets, alternated round by round (each round starts one target later), each on a fresh set of
// namespaces built with internal/testbed (client -> node -> pod):
//
//   - old: -old on a services file (no flow stream: it predates it);
//   - new: -new on the same file (the flow stream on, as by default, with no observer);
//   - new+N obs: -new with N observers (-observers) following /debug/flows on the node's
//     loopback with a filter (service=bench/echo, phase=end) and reading as fast as they can.
//
// Loads, from the client namespace to the Service's cluster IP (an echo server in the pod):
// keep-alive (-conc connections, each sending 64-byte requests and reading the echo, back to
// back) and conn (-conc clients, each connecting, exchanging 64 bytes and closing, back to
// back). Each is measured for -dur after -warmup; the proxy's CPU is utime+stime of its process
// tree (/proc), per request and per connection. The table shows each figure's median over the
// rounds and the ratios of the done-when: CPU new/old with no observer (<= 1.02), and the rate
// with observers over the rate without (>= 0.95).
//
// Every process (backend, load, observers, proxies) is a child in its own namespace and dies
// with the harness; every namespace is deleted at the end, also on error or Ctrl-C. Every load is
// bounded in time (-dur) and count (-max-ops).
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// The Service the proxies serve, the pod's echo port and the proxy's metrics (and flows) address
// on the node namespace's loopback.
var echoVIP = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.10"), 80)

const (
	echoPort    = 8080
	metricsAddr = "127.0.0.1:10249"
	// observeQuery is what each observer asks for by default (-observe): a filter that passes the load's flows' End
	// events, so every connection of the conn load is one event to each observer.
	observeQuery = "follow=1&service=bench/echo&phase=end"
)

type config struct {
	newBin, oldBin string
	rounds         int
	dur, warmup    time.Duration
	conc           int
	observers      int
	observe        string // the observers' query
	maxOps         int64
	tests          []string
	extra          []string
	// oldExtra and newExtra are more flags for one target's proxy only (e.g. the same build
	// with --source-mode=proxy as old and =transparent as new).
	oldExtra, newExtra []string
	timeout            time.Duration
}

func main() {
	role := flag.String("role", "bench", "bench | backend | load | observers (internal)")
	var cfg config
	flag.StringVar(&cfg.newBin, "new", "bin/kube-portal-proxy", "the kube-portal-proxy build under test (make build)")
	flag.StringVar(&cfg.oldBin, "old", "", "the build to compare with (e.g. 44a0773, before #36); empty: only new and new with observers")
	flag.IntVar(&cfg.rounds, "rounds", 3, "rounds over all targets; the table shows medians")
	flag.DurationVar(&cfg.dur, "dur", 2*time.Second, "measured time of each load")
	flag.DurationVar(&cfg.warmup, "warmup", 300*time.Millisecond, "unmeasured time before each load")
	flag.IntVar(&cfg.conc, "conc", 16, "concurrent clients of each load")
	flag.IntVar(&cfg.observers, "observers", 10, "observers of target new+N obs; 0 drops the target")
	flag.Int64Var(&cfg.maxOps, "max-ops", 20_000_000, "most operations of one load, whatever -dur")
	tests := flag.String("tests", "keepalive,conn", "the loads, comma-separated")
	flag.StringVar(&cfg.observe, "observe", observeQuery, "the observers' /debug/flows query: the default passes every flow's end; e.g. follow=1&verdict=reset passes none of the load's")
	extra := flag.String("proxy-args", "", "more flags for both proxies, space-separated (e.g. --io-engine=epoll)")
	oldExtra := flag.String("old-args", "", "more flags for the old target's proxy only, after -proxy-args")
	newExtra := flag.String("new-args", "", "more flags for the new targets' proxies only, after -proxy-args")
	flag.DurationVar(&cfg.timeout, "timeout", 20*time.Minute, "hard limit of the whole run")
	// The children's flags.
	test := flag.String("test", "", "load: keepalive or conn")
	addr := flag.String("addr", "", "load: the address to load; observers: the flows URL")
	pid := flag.Int("pid", 0, "load: the proxy to measure")
	n := flag.Int("n", 0, "observers: how many")
	flag.Parse()
	cfg.tests = strings.Split(*tests, ",")
	cfg.extra = strings.Fields(*extra)
	cfg.oldExtra, cfg.newExtra = strings.Fields(*oldExtra), strings.Fields(*newExtra)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	switch *role {
	case "bench":
		ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
		defer cancel()
		err = runBench(ctx, cfg)
	case "backend":
		err = runBackend()
	case "load":
		err = runLoad(*test, *addr, *pid, cfg)
	case "observers":
		err = runObservers(*addr, *n)
	default:
		err = fmt.Errorf("unknown role %q", *role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench/flows (%s): %v\n", *role, err)
		os.Exit(1)
	}
}

// --- children -----------------------------------------------------------------------------

// runBackend echoes on echoPort until stdin closes, printing "ready" first.
func runBackend() error {
	ln, err := net.Listen("tcp4", fmt.Sprintf(":%d", echoPort))
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue // EMFILE and the like: the client counts a failure
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if _, err := c.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return ln.Close()
}

// loadResult is a load child's answer, one JSON line.
type loadResult struct {
	Ops     int64   `json:"ops"`
	Errors  int64   `json:"errors"`
	Seconds float64 `json:"seconds"`
	CPU     float64 `json:"cpu_s"` // the proxy's, over the measured time
}

// runLoad runs test against addr with cfg.conc clients for cfg.warmup+cfg.dur (at most
// cfg.maxOps operations) and prints what the measured part did.
func runLoad(test, addr string, pid int, cfg config) error {
	var op func(c *net.Conn, buf []byte) error
	msg := bytes.Repeat([]byte("k"), 64)
	exchange := func(c net.Conn, buf []byte) error {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(msg); err != nil {
			return err
		}
		_, err := io.ReadFull(c, buf[:len(msg)])
		return err
	}
	switch test {
	case "keepalive":
		op = func(c *net.Conn, buf []byte) error {
			if *c == nil {
				var err error
				if *c, err = net.DialTimeout("tcp4", addr, 5*time.Second); err != nil {
					return err
				}
			}
			if err := exchange(*c, buf); err != nil {
				(*c).Close()
				*c = nil
				return err
			}
			return nil
		}
	case "conn":
		op = func(_ *net.Conn, buf []byte) error {
			c, err := net.DialTimeout("tcp4", addr, 5*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			return exchange(c, buf)
		}
	default:
		return fmt.Errorf("unknown test %q", test)
	}
	var ops, errs atomic.Int64
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range cfg.conc {
		wg.Go(func() {
			var c net.Conn
			defer func() {
				if c != nil {
					c.Close()
				}
			}()
			buf := make([]byte, 4096)
			for !stop.Load() && ops.Load()+errs.Load() < cfg.maxOps {
				if err := op(&c, buf); err != nil {
					errs.Add(1)
					continue
				}
				ops.Add(1)
			}
		})
	}
	time.Sleep(cfg.warmup) // the load runs meanwhile: this is its unmeasured part
	ops0, errs0, cpu0, t0 := ops.Load(), errs.Load(), procstat.CPUTime(pid), time.Now()
	time.Sleep(cfg.dur) // the measured part
	ops1, errs1, cpu1, t1 := ops.Load(), errs.Load(), procstat.CPUTime(pid), time.Now()
	stop.Store(true)
	wg.Wait()
	return json.NewEncoder(os.Stdout).Encode(loadResult{Ops: ops1 - ops0, Errors: errs1 - errs0,
		Seconds: t1.Sub(t0).Seconds(), CPU: (cpu1 - cpu0).Seconds()})
}

// observerResult is the observers child's answer: events and lost events over all observers.
type observerResult struct {
	Events int64            `json:"events"`
	Lost   map[string]int64 `json:"lost"`
	Errors []string         `json:"errors,omitempty"`
}

// runObservers follows url with n observers, each reading as fast as it can, prints "ready"
// once every one has its response header, and on stdin's close prints their counts.
func runObservers(url string, n int) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	res := observerResult{Lost: map[string]int64{}}
	var wg sync.WaitGroup
	var started sync.WaitGroup
	for range n {
		started.Add(1)
		wg.Go(func() {
			var events int64
			lost := map[string]int64{}
			err := observe(ctx, url, &started, &events, lost)
			mu.Lock()
			defer mu.Unlock()
			res.Events += events
			for k, v := range lost {
				res.Lost[k] += v
			}
			if err != nil && ctx.Err() == nil {
				res.Errors = append(res.Errors, err.Error())
			}
		})
	}
	started.Wait()
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	cancel()
	wg.Wait()
	return json.NewEncoder(os.Stdout).Encode(res)
}

// observe reads one stream to its end, counting flow items and the lost counts.
func observe(ctx context.Context, url string, started *sync.WaitGroup, events *int64, lost map[string]int64) error {
	once := sync.OnceFunc(started.Done)
	defer once()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", url, resp.Status, b)
	}
	once()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte(`{"lost"`)) {
			*events++
			continue
		}
		var it struct {
			Lost struct {
				Count  int64  `json:"count"`
				Reason string `json:"reason"`
			} `json:"lost"`
		}
		if json.Unmarshal(line, &it) == nil {
			lost[it.Lost.Reason] += it.Lost.Count
		}
	}
	return sc.Err()
}

// --- the harness --------------------------------------------------------------------------

// target is one proxy configuration.
type target struct {
	name      string
	bin       string
	observers int
	args      []string // the target's own flags (-old-args, -new-args)
}

// sample is one target's figures in one round, by metric.
type sample map[string]float64

const (
	mReq        = "keepalive req/s"
	mCPUReq     = "CPU µs/req"
	mConn       = "conn/s"
	mCPUConn    = "CPU µs/conn"
	mObsEvents  = "obs events/s" // over all observers, over both loads and the time between
	mObsLost    = "obs lost"     // events the server did not send them (rate cap, slow)
	mLoadErrors = "load errors"
	// mTransparent is the share of the endpoint dials made from the client's address (the
	// transparent source mode's kube_portal_proxy_transparent_dials_total over the dial attempts):
	// shown only where the proxy runs the mode, so a run says that it measured what it meant to.
	mTransparent = "transparent share"
)

var metrics = []string{mReq, mCPUReq, mConn, mCPUConn, mObsEvents, mObsLost, mLoadErrors, mTransparent}

func runBench(ctx context.Context, cfg config) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: it builds network namespaces and the proxies install iptables rules in them")
	}
	var targets []target
	for _, b := range []*string{&cfg.newBin, &cfg.oldBin} {
		if *b == "" {
			continue
		}
		abs, err := filepath.Abs(*b)
		if err != nil {
			return err
		}
		if fi, err := os.Stat(abs); err != nil || fi.IsDir() {
			return fmt.Errorf("proxy binary %s: not a file (%v)", abs, err)
		}
		*b = abs
	}
	if cfg.oldBin != "" {
		targets = append(targets, target{name: "old", bin: cfg.oldBin, args: cfg.oldExtra})
	}
	targets = append(targets, target{name: "new", bin: cfg.newBin, args: cfg.newExtra})
	if cfg.observers > 0 {
		targets = append(targets, target{name: fmt.Sprintf("new+%d obs", cfg.observers), bin: cfg.newBin, observers: cfg.observers, args: cfg.newExtra})
	}
	fmt.Printf("bench/flows: %d rounds of %s, %v each after %v warm-up, %d clients; new=%s old=%s\n",
		cfg.rounds, strings.Join(cfg.tests, ","), cfg.dur, cfg.warmup, cfg.conc, cfg.newBin, orNone(cfg.oldBin))
	samples := map[string][]sample{}
	for round := range cfg.rounds {
		for i := range targets {
			t := targets[(round+i)%len(targets)]
			s, err := measureTarget(ctx, cfg, t)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round+1, t.name, err)
			}
			samples[t.name] = append(samples[t.name], s)
			fmt.Printf("  round %d %-12s %s\n", round+1, t.name, s)
		}
	}
	printTable(os.Stdout, targets, samples)
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func (s sample) String() string {
	var parts []string
	for _, m := range metrics {
		if v, ok := s[m]; ok {
			parts = append(parts, fmt.Sprintf("%s=%.4g", m, v))
		}
	}
	return strings.Join(parts, " ")
}

// measureTarget runs every load against t on a fresh bed.
func measureTarget(ctx context.Context, cfg config, t target) (_ sample, err error) {
	lab, err := netns.NewLab()
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := lab.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	dir, err := os.MkdirTemp("", lab.Prefix())
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	tb, err := testbed.New(ctx, lab, 1)
	if err != nil {
		return nil, err
	}
	// Inside the bed only: the node and client may reuse TIME_WAIT ports for the conn load.
	for _, ns := range []*netns.NS{tb.Node, tb.Client} {
		for _, kv := range []string{"net.ipv4.tcp_tw_reuse=1", "net.ipv4.ip_local_port_range=1024 65000"} {
			if _, err := ns.Exec(ctx, "sysctl", "-q", "-w", kv); err != nil {
				return nil, fmt.Errorf("%s sysctl %s: %w", ns.Name, kv, err)
			}
		}
	}
	backend, err := startSelf(ctx, tb.Pods[0].NS, "backend")
	if err != nil {
		return nil, err
	}
	defer backend.stop(0, 5*time.Second)
	if l, err := backend.line(); err != nil || l != "ready" {
		return nil, fmt.Errorf("backend did not start: %q %v", l, err)
	}

	proxy, logPath, err := startProxy(ctx, cfg, t, tb, dir)
	if err != nil {
		return nil, err
	}
	defer proxy.stop(syscall.SIGTERM, 10*time.Second)
	fail := func(err error) (sample, error) {
		tail, _ := os.ReadFile(logPath)
		return nil, fmt.Errorf("%w; proxy log:\n%s", err, lastLines(string(tail), 10))
	}
	if err := waitEcho(ctx, tb, proxy); err != nil {
		return fail(err)
	}
	var obs *child
	if t.observers > 0 {
		url := "http://" + metricsAddr + "/debug/flows?" + cfg.observe
		if obs, err = startSelf(ctx, tb.Node, "observers", "-addr", url, "-n", strconv.Itoa(t.observers)); err != nil {
			return fail(err)
		}
		defer obs.stop(0, 5*time.Second)
		if l, err := obs.line(); err != nil || l != "ready" {
			return fail(fmt.Errorf("observers did not start: %q %v", l, err))
		}
	}
	s := sample{}
	start := time.Now()
	for _, test := range cfg.tests {
		res, err := load(ctx, cfg, tb, test, proxy.pid())
		if err != nil {
			return fail(fmt.Errorf("%s: %w", test, err))
		}
		rate, cpu := mReq, mCPUReq
		if test == "conn" {
			rate, cpu = mConn, mCPUConn
		}
		s[rate] = float64(res.Ops) / res.Seconds
		if res.Ops > 0 {
			s[cpu] = res.CPU / float64(res.Ops) * 1e6
		}
		s[mLoadErrors] += float64(res.Errors)
	}
	if obs != nil {
		_ = obs.stdin.Close()
		line, err := obs.line()
		if err != nil {
			return fail(fmt.Errorf("observers: %w", err))
		}
		var res observerResult
		if err := json.Unmarshal([]byte(line), &res); err != nil {
			return fail(fmt.Errorf("observers said %q: %w", line, err))
		}
		if len(res.Errors) > 0 {
			return fail(fmt.Errorf("observers failed: %s", strings.Join(res.Errors, "; ")))
		}
		s[mObsEvents] = float64(res.Events) / time.Since(start).Seconds()
		s[mObsLost] = 0
		for _, v := range res.Lost {
			s[mObsLost] += float64(v)
		}
	}
	if !proxy.alive() {
		return fail(errors.New("the proxy exited during the loads"))
	}
	if share, ok := transparentShare(tb.Node); ok {
		s[mTransparent] = share
	}
	return s, nil
}

// transparentShare reads, from the proxy's /metrics in node, the dials made from the clients'
// addresses over all dial attempts; false when the proxy has no transparent port.
func transparentShare(node *netns.NS) (float64, bool) {
	// The socket is made on the namespace's thread (an http.Client would dial on another).
	var c net.Conn
	if err := node.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", metricsAddr, 5*time.Second)
		return err
	}); err != nil {
		return 0, false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "GET /metrics HTTP/1.0\r\nHost: metrics\r\n\r\n"); err != nil {
		return 0, false
	}
	body, err := io.ReadAll(c)
	if err != nil {
		return 0, false
	}
	var transparent, attempts float64
	found := false
	for _, line := range strings.Split(string(body), "\n") {
		v, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
		switch {
		case err != nil:
		case strings.HasPrefix(line, "kube_portal_proxy_transparent_dials_total{") && strings.Contains(line, `result="transparent"`):
			transparent, found = transparent+v, true
		case strings.HasPrefix(line, "kube_portal_proxy_tcp_dial_attempts_total{"):
			attempts += v
		}
	}
	if !found || attempts == 0 {
		return 0, false
	}
	return transparent / attempts, true
}

// startProxy runs t's binary in the node namespace on a services file holding the echo Service.
func startProxy(ctx context.Context, cfg config, t target, tb *testbed.Bed, dir string) (*child, string, error) {
	file := filepath.Join(dir, "services.yaml")
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: echo, namespace: bench}
spec: {clusterIP: %s, ports: [{name: tcp, protocol: TCP, port: %d, targetPort: %d}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: echo-1, namespace: bench, labels: {kubernetes.io/service-name: echo}}
addressType: IPv4
ports: [{name: tcp, protocol: TCP, port: %d}]
endpoints:
- addresses: ["%s"]
`, echoVIP.Addr(), echoVIP.Port(), echoPort, echoPort, testbed.PodIP(1))
	if err := os.WriteFile(file, []byte(manifest), 0o644); err != nil {
		return nil, "", err
	}
	logPath := filepath.Join(dir, "proxy.log")
	log, err := os.Create(logPath)
	if err != nil {
		return nil, "", err
	}
	defer log.Close()
	// The same flags for both builds: only what the old one knows too.
	args := append([]string{t.bin, "--services-file", file,
		"--healthz-bind-address", "", "--metrics-bind-address", metricsAddr, "--log-level", "warn",
		"--iptables-min-sync-period", "100ms", "--shutdown-timeout", "2s", "--oom-score-adj", "0",
		// Leave conntrack sysctls alone: nf_conntrack_max is not the bed's to set.
		"--conntrack-max-per-core", "0", "--conntrack-tcp-timeout-established", "0",
		"--conntrack-tcp-timeout-close-wait", "0"}, cfg.extra...)
	args = append(args, t.args...)
	c, err := startChild(ctx, tb.Node, "kube-portal-proxy", log, args...)
	return c, logPath, err
}

// waitEcho waits (20 s) until an echo exchange through the Service works from the client.
func waitEcho(ctx context.Context, tb *testbed.Bed, proxy *child) error {
	return testbed.Eventually(ctx, 20*time.Second, 50*time.Millisecond, func() error {
		if !proxy.alive() {
			return errors.New("the proxy exited")
		}
		c, err := testbed.Dial(tb.Client, echoVIP, 300*time.Millisecond)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
		if _, err := c.Write([]byte("probe")); err != nil {
			return err
		}
		_, err = io.ReadFull(c, make([]byte, 5))
		return err
	})
}

// load runs one load in a child in the client namespace.
func load(ctx context.Context, cfg config, tb *testbed.Bed, test string, pid int) (loadResult, error) {
	var res loadResult
	ctx, cancel := context.WithTimeout(ctx, cfg.warmup+cfg.dur+60*time.Second)
	defer cancel()
	c, err := startSelf(ctx, tb.Client, "load", "-test", test, "-addr", echoVIP.String(), "-pid", strconv.Itoa(pid),
		"-dur", cfg.dur.String(), "-warmup", cfg.warmup.String(), "-conc", strconv.Itoa(cfg.conc),
		"-max-ops", strconv.FormatInt(cfg.maxOps, 10))
	if err != nil {
		return res, err
	}
	defer c.stop(0, 10*time.Second)
	line, err := c.line()
	if err != nil {
		return res, err
	}
	if err := json.Unmarshal([]byte(line), &res); err != nil {
		return res, fmt.Errorf("load said %q: %w", line, err)
	}
	return res, nil
}

// printTable writes each metric's median per target, and the done-when's ratios.
func printTable(w io.Writer, targets []target, samples map[string][]sample) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "median\t")
	for _, t := range targets {
		fmt.Fprintf(tw, "%s\t", t.name)
	}
	fmt.Fprintln(tw)
	med := map[string]map[string]float64{}
	for _, t := range targets {
		med[t.name] = map[string]float64{}
		for _, m := range metrics {
			if v, ok := median(samples[t.name], m); ok {
				med[t.name][m] = v
			}
		}
	}
	for _, m := range metrics {
		fmt.Fprintf(tw, "%s\t", m)
		for _, t := range targets {
			if v, ok := med[t.name][m]; ok {
				fmt.Fprintf(tw, "%.4g\t", v)
			} else {
				fmt.Fprint(tw, "-\t")
			}
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	ratio := func(label, a, b, m, want string) {
		va, oka := med[a][m]
		vb, okb := med[b][m]
		if oka && okb && vb != 0 {
			fmt.Fprintf(w, "%-40s %.3f  (done-when: %s)\n", label, va/vb, want)
		}
	}
	fmt.Fprintln(w)
	ratio("CPU per keep-alive request, new/old", "new", "old", mCPUReq, "<= 1.02")
	ratio("CPU per new connection, new/old", "new", "old", mCPUConn, "<= 1.02")
	for _, t := range targets {
		if t.observers > 0 {
			ratio("keep-alive req/s, "+t.name+"/new", t.name, "new", mReq, ">= 0.95")
			ratio("conn/s, "+t.name+"/new", t.name, "new", mConn, ">= 0.95")
		}
	}
}

func median(ss []sample, m string) (float64, bool) {
	var vs []float64
	for _, s := range ss {
		if v, ok := s[m]; ok {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return 0, false
	}
	slices.Sort(vs)
	if len(vs)%2 == 1 {
		return vs[len(vs)/2], true
	}
	return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2, true
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// --- children's processes -------------------------------------------------------------------

// child is one process in a namespace (`ip netns exec` execs it, so its PID is the command's),
// killed if the harness dies (PR_SET_PDEATHSIG) and stopped by closing its stdin or a signal.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
	// closeOut closes the read end of stdout, once the child is gone (stop): what it printed
	// before it exited is still read.
	closeOut func() error
	exited   chan struct{}
}

func startChild(ctx context.Context, ns *netns.NS, name string, errw io.Writer, argv ...string) (*child, error) {
	args := append(ns.CommandPrefix(), argv...)
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = errw
	if errw == nil {
		cmd.Stderr = os.Stderr
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	// An os.Pipe, not StdoutPipe: Wait would close that as soon as the child exits, losing the
	// last line of a child that prints its result and exits.
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		return nil, fmt.Errorf("%s: start: %w", name, err)
	}
	c := &child{cmd: cmd, stdin: stdin, out: bufio.NewReader(r), closeOut: r.Close, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.exited) }()
	return c, nil
}

// startSelf runs this binary in another role inside ns.
func startSelf(ctx context.Context, ns *netns.NS, role string, args ...string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return startChild(ctx, ns, role, nil, append([]string{self, "-role", role}, args...)...)
}

func (c *child) pid() int { return c.cmd.Process.Pid }

// line reads one line of the child's stdout (its context bounds the wait).
func (c *child) line() (string, error) {
	s, err := c.out.ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(s), nil
}

// stop closes stdin, sends sig (0: none) and waits up to grace before killing.
func (c *child) stop(sig syscall.Signal, grace time.Duration) {
	_ = c.stdin.Close()
	if sig != 0 {
		_ = c.cmd.Process.Signal(sig)
	}
	select {
	case <-c.exited:
	case <-time.After(grace):
		_ = c.cmd.Process.Kill()
		<-c.exited
	}
	_ = c.closeOut()
}

func (c *child) alive() bool {
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}
