// Command suite is the benchmark harness of `make bench` (not run in CI; needs root): in
// throwaway network namespaces built with internal/testbed (client -> node -> pod), it measures
// side by side in one run, alternating targets round by round:
//
//   - direct: the client reaches the pod, routed through the node;
//   - kpp iptables: the real bin/kube-portal-proxy (--services-file) with iptables portals, the
//     client connecting to the cluster IP;
//   - kpp kernel: the same binary with --default-data-path kernel: kube-proxy's iptables chains
//     DNAT the cluster IP straight to the pod, nothing in user space (the proxy's CPU is ~0);
//   - kpp bind: the same binary in --portal-mode=bind;
//   - kpp iptables epoll, kpp bind epoll: the same two with --io-engine=epoll (the others run the
//     default engine: io_uring where the kernel allows it);
//   - kpp iptables 2 UDP loops, kpp bind 2 UDP loops: the same two with --udp-loops 2 (the
//     default is one loop per UDP service port);
//   - haproxy (TCP) and nginx stream (TCP and UDP) in the node namespace, on the node address;
//   - legacy v1.25: the real userspace kube-proxy of Kubernetes v1.25 (hack/legacy-build.sh),
//     reading the suite's Services and Endpoints from a real API server (e2e/framework);
//   - ceiling: ceiling/ceiling.c, compiled with cc, the leanest bulk-TCP and UDP forwarder we can
//     write, to show how much of the direct rate any user-space proxy keeps on this machine.
//
// Metrics: bulk Gbit/s, connections/s (one small exchange each), keep-alive requests/s, UDP
// 64-byte request/response exchanges/s, the proxy's CPU per operation (utime+stime of its process
// tree from /proc/<pid>/stat), RSS and descriptors for N idle connections, and the rules-sync
// times of the daemon at 1,000 service ports (bench/scale). It prints a table with ratios to
// direct and, with -json, writes every sample and median to a file.
//
//	sudo go run ./bench/suite [-quick] [-reps 3] [-json bench.json]
//
// A/B: -old-proxy /tmp/kpp-main adds "old iptables" and "old bind", the same targets on another
// build, alternated with the new ones round by round; -loads udp,real runs only those loads.
//
// Every process (backend, each load's clients, each proxy) is a child in its own namespace;
// every namespace is deleted at the end, also on error or Ctrl-C.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// config is the bench role's flags.
type config struct {
	proxy        string
	oldProxy     string
	legacy       string
	loads        string
	real         bool
	redisReqs    int
	reps         int
	dur, warmup  time.Duration
	bulkMiB      int64
	conc         int
	udpClients   int
	idle         int
	settle       time.Duration
	only         string
	jsonPath     string
	syncServices int
	syncIdle     time.Duration
	syncChanges  int
	goTool       string
	nginxModule  string
	timeout      time.Duration
	compare      string
}

func main() {
	role := flag.String("role", "bench", "bench | backend | client (internal)")
	var cfg config
	flag.StringVar(&cfg.proxy, "proxy", "bin/kube-portal-proxy", "the kube-portal-proxy binary (make build)")
	flag.StringVar(&cfg.oldProxy, "old-proxy", "", "another kube-portal-proxy binary (a build of main) whose targets run beside -proxy's in every round: \"old iptables\", \"old bind\" (selected with -only old-iptables,old-bind)")
	flag.StringVar(&cfg.loads, "loads", "", "comma-separated loads to run (bulk,conn,keepalive,udp,real,idle); empty = all")
	flag.StringVar(&cfg.legacy, "legacy", legacyBinary(), "the legacy v1.25 userspace kube-proxy (hack/legacy-build.sh)")
	flag.BoolVar(&cfg.real, "real", true, "also measure real clients: redis-benchmark against redis-server, dnsperf against unbound")
	flag.IntVar(&cfg.redisReqs, "redis-requests", 100000, "requests of each redis-benchmark test (SET, GET)")
	flag.IntVar(&cfg.reps, "reps", 3, "rounds over all targets; the table shows each figure's median")
	flag.DurationVar(&cfg.dur, "dur", 2*time.Second, "measured time of each rate test")
	flag.DurationVar(&cfg.warmup, "warmup", 200*time.Millisecond, "unmeasured time before the keep-alive and UDP tests")
	flag.Int64Var(&cfg.bulkMiB, "bulk-mib", 1024, "bytes sent by the bulk test, MiB")
	flag.IntVar(&cfg.conc, "conc", 16, "concurrent clients of the TCP rate tests")
	flag.IntVar(&cfg.udpClients, "udp-clients", 32, "concurrent clients of the UDP test")
	flag.IntVar(&cfg.idle, "idle", 9000, "idle connections of the memory test (lowered to fit the descriptor limit)")
	flag.DurationVar(&cfg.settle, "settle", 3*time.Second, "how long the idle connections are held before measuring")
	flag.StringVar(&cfg.only, "only", "", "comma-separated targets (direct,iptables,iptables-epoll,iptables-2loops,kernel,bind,bind-epoll,bind-2loops,haproxy,nginx,legacy,ceiling,compare,old-iptables,old-bind); empty = all")
	flag.StringVar(&cfg.jsonPath, "json", "", "write the results as JSON to this file")
	flag.IntVar(&cfg.syncServices, "sync-services", 1000, "service ports of the rules-sync measurement (bench/scale); 0 skips it")
	flag.DurationVar(&cfg.syncIdle, "sync-idle", 3*time.Second, "bench/scale -idle")
	flag.IntVar(&cfg.syncChanges, "sync-changes", 5, "bench/scale -changes")
	flag.StringVar(&cfg.goTool, "go", "go", "the go command, to build bench/scale")
	flag.StringVar(&cfg.nginxModule, "nginx-module", "/usr/lib/nginx/modules/ngx_stream_module.so", "nginx stream module")
	flag.DurationVar(&cfg.timeout, "timeout", 25*time.Minute, "hard limit of the whole run (3 rounds of every target with -dur 5s took 11 min here)")
	flag.StringVar(&cfg.compare, "compare", "", "another TCP proxy command to add as target \"compare\" (see compareTarget), e.g. an older build of bench/tcp")
	quick := flag.Bool("quick", false, "one short round: -reps 1 -dur 1s -bulk-mib 256 -idle 3000 -settle 1s -sync-idle 1s -sync-changes 3 -redis-requests 20000 (explicit flags win)")
	var spec loadSpec
	flag.StringVar(&spec.Test, "test", "", "client: bulk, bulk-framed, conn, keepalive, udp, idle")
	flag.StringVar(&spec.Addr, "addr", "", "client: address to load")
	flag.IntVar(&spec.PID, "pid", 0, "client: proxy PID to measure")
	flag.Int64Var(&spec.Bytes, "bytes", 0, "client: bulk bytes")
	flag.IntVar(&spec.Size, "size", 64, "client: request size")
	flag.IntVar(&spec.N, "n", 0, "client: idle connections")
	flag.DurationVar(&spec.Timeout, "op-timeout", 5*time.Second, "client: per-operation timeout")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	switch *role {
	case "backend":
		err = runBackend(ctx)
	case "client":
		spec.Dur, spec.Warmup, spec.Conc = cfg.dur, cfg.warmup, cfg.conc
		err = runClient(spec)
	case "bench":
		if *quick {
			applyQuick(&cfg)
		}
		err = runBench(ctx, cfg)
	default:
		err = fmt.Errorf("unknown role %q", *role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench/suite (%s): %v\n", *role, err)
		os.Exit(1)
	}
}

// applyQuick shortens every flag the command line did not set.
func applyQuick(cfg *config) {
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	quick := []struct {
		name string
		fn   func()
	}{
		{"reps", func() { cfg.reps = 1 }},
		{"dur", func() { cfg.dur = time.Second }},
		{"bulk-mib", func() { cfg.bulkMiB = 256 }},
		{"idle", func() { cfg.idle = 3000 }},
		{"settle", func() { cfg.settle = time.Second }},
		{"sync-idle", func() { cfg.syncIdle = time.Second }},
		{"sync-changes", func() { cfg.syncChanges = 3 }},
		{"redis-requests", func() { cfg.redisReqs = 20000 }},
	}
	for _, q := range quick {
		if !set[q.name] {
			q.fn()
		}
	}
}
