// Command scale measures the daemon at scale, with the real binary in throwaway network
// namespaces: time to serve N service ports from a cold start and the CPU that took (the
// proxy's and its iptables commands', a figure a shared machine's load hardly moves), its RSS
// (and peak) and idle CPU with them loaded, and the network programming latency of one change
// (a new Service + EndpointSlice until traffic through its cluster IP works). -cpuprofile and
// -trace fetch a profile or an execution trace of the cold start from the proxy's /debug/pprof.
// -cluster runs against a real API server instead (etcd + kube-apiserver from e2e/framework),
// with today's kube-proxy beside the daemon (-kube-proxy, iptables and nftables modes): per
// target and round, the cold start (process start -> initial lists -> every rule in force), then a
// steady churn of EndpointSlice changes with the change-to-effect latency seen from a client and
// the targets' own network_programming_duration_seconds, CPU per minute and RSS (cluster.go).
// Not part of CI: go run ./bench/scale (as root).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// logLevel is the file mode daemon's --log-level (-log-level).
var logLevel = "warn"

// restartSnapshot is -restart-snapshot; snapshotFile the file the proxy keeps it in then.
var (
	restartSnapshot bool
	snapshotFile    string
)

// restarts is -restart-runs, -planned and -hog (restarts.go).
var restarts restartOptions

func main() {
	flag.StringVar(&logLevel, "log-level", logLevel, "file mode: the daemon's --log-level (its log goes to stderr)")
	proxy := flag.String("proxy", "bin/kube-portal-proxy", "the binary")
	services := flag.Int("services", 10000, "service ports to load")
	endpoints := flag.Int("endpoints", 5, "endpoints per service port")
	idle := flag.Duration("idle", 20*time.Second, "how long to measure idle CPU")
	changes := flag.Int("changes", 5, "programming-latency samples")
	restart := flag.Bool("restart", true, "also SIGKILL the proxy and restart it at once, measuring what a client sees")
	flag.BoolVar(&restartSnapshot, "restart-snapshot", false, "file mode: run the proxy with --restart-snapshot-file (a file in a temporary directory) and, before the SIGKILL, wait until the snapshot holds the probed service (a binary without the flag does not start)")
	flag.IntVar(&restarts.runs, "restart-runs", 0, "file mode and -cluster: instead of the single SIGKILL restart, this many in a row (and as many planned ones with -planned), each reported, the next once the restarted proxy serves everything and has written its snapshot")
	flag.BoolVar(&restarts.planned, "planned", false, "with -restart-runs: also planned restarts (both processes with --handover-socket; successor started, SIGTERM to the old one 15 s later; a client connecting every 5 ms, failing a connection whose greeting takes over 1 s)")
	flag.StringVar(&pcapDir, "pcap", "", "with -restart-runs: capture each SIGKILL run's packets (tcpdump, ports 80 and 8080) in the client's and the node's namespaces into this directory")
	flag.DurationVar(&restarts.hog, "hog", 0, "with -restart-runs: during each restart, one busy loop per CPU at normal priority, ending after this long at most (0: none)")
	flag.StringVar(&profile.cpu, "cpuprofile", "", "write a CPU profile of the proxy's cold start (from /debug/pprof) to this file")
	flag.StringVar(&profile.trace, "trace", "", "write an execution trace of the proxy's cold start (from /debug/pprof) to this file")
	flag.StringVar(&profile.heap, "heapprofile", "", "-cluster or file mode with -baseline: write a heap profile of each daemon after its first cold start (/debug/pprof/heap) to this file, the target's name added")
	flag.DurationVar(&profile.length, "profile-length", 8*time.Second, "how long the cold start's profile or trace runs")
	cluster := flag.Bool("cluster", false, "read Services and EndpointSlices from a real API server (etcd + kube-apiserver on loopback, created by -workers concurrent clients) instead of a services file: cold starts and churn, beside -baseline and -kube-proxy")
	workers := flag.Int("workers", 32, "-cluster: concurrent clients creating the objects")
	baseline := flag.String("baseline", "", "other binaries (space-separated) run in the same run, in turn with -proxy, for a side-by-side figure; in file mode (each may be KEY=VALUE,...@binary: its environment, e.g. GOMEMLIMIT=100MiB@bin/kube-portal-proxy): cold starts and a churn of rewritten files (-rounds, -churn, -churn-rate, -heapprofile) instead of the single run")
	kubeProxy := flag.String("kube-proxy", "", "-cluster: a kube-proxy binary (hack/kubeproxy-build.sh) run in the same run in each of -kube-proxy-modes")
	kubeProxyModes := flag.String("kube-proxy-modes", "iptables,nftables", "-cluster: kube-proxy's modes to run (comma-separated)")
	minSync := flag.Duration("min-sync-period", 100*time.Millisecond, "-cluster: the minimum sync period of every target (the daemon's --iptables-min-sync-period, kube-proxy's iptables/nftables minSyncPeriod; kube-proxy's own default is 1s)")
	rounds := flag.Int("rounds", 1, "-cluster: rounds (cold start, then churn) per target")
	churn := flag.Duration("churn", 30*time.Second, "-cluster: length of the churn period after each cold start (0: none)")
	churnRate := flag.Int("churn-rate", 50, "-cluster: EndpointSlice changes per second during the churn")
	startLimit := flag.Duration("start-limit", 10*time.Minute, "-cluster: a target whose rules are not in force this long after its start is recorded as such and not run again")
	flag.Parse()
	if !*cluster && *baseline != "" {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		err := compareFile(ctx, append([]string{*proxy}, strings.Fields(*baseline)...), *services, *endpoints, *rounds, *churn, max(*churnRate, 1))
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "scale:", err)
			os.Exit(1)
		}
		return
	}
	if *cluster {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		targets, err := parseTargets(*proxy, *baseline, *kubeProxy, *kubeProxyModes, *minSync)
		if err == nil {
			err = runCluster(ctx, targets, clusterOptions{services: *services, endpoints: *endpoints, workers: *workers, restarts: restarts,
				rounds: *rounds, churn: *churn, churnRate: max(*churnRate, 1), startLimit: *startLimit})
		}
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "scale:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(*proxy, *services, *endpoints, *idle, *changes, *restart); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(1)
	}
}

func run(proxy string, nServices, nEndpoints int, idle time.Duration, nChanges int, restart bool) (err error) {
	// Ctrl-C or a timeout still removes the namespaces.
	ctx, stopSignals := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stopSignals()
	proxy, _ = filepath.Abs(proxy)
	bed, closeBed, err := testbed.Start(ctx, 1, 8080, 5353)
	defer func() { err = errors.Join(err, closeBed()) }()
	if err != nil {
		return err
	}

	dir, err := os.MkdirTemp("", "kpp-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.WriteFile(filepath.Join(dir, "bulk.yaml"), []byte(bulkManifests(nServices, nEndpoints)), 0o644); err != nil {
		return err
	}

	if restartSnapshot {
		snapDir, err := os.MkdirTemp("", "kpp-scale-snapshot-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(snapDir)
		snapshotFile = filepath.Join(snapDir, "restart-snapshot")
	}
	if restarts.planned {
		sockDir, err := os.MkdirTemp("", "kpp-scale-handover-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(sockDir)
		restarts.handoverSocket = filepath.Join(sockDir, "handover.sock")
	}

	start := time.Now()
	cmd, _, err := startProxy(proxy, bed, dir)
	if err != nil {
		return err
	}
	defer func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() }()
	profiled := profileStart(ctx, bed)
	// The last service port's portal accepting a connection marks the end of the initial sync;
	// the rule count then confirms the whole of it is in force.
	synced, err := waitPortal(ctx, bed, netip.AddrPortFrom(clusterIP(nServices-1), 80))
	if err != nil {
		return err
	}
	cold := synced.Sub(start)
	// The CPU the start took, read at once (a measure the machine's load hardly changes, unlike the
	// wall time): the proxy's own, and that of the iptables commands it ran and waited for.
	coldSelf, coldChildren := procstat.OwnCPUTime(cmd.Process.Pid)
	if err := waitRules(ctx, bed, nServices); err != nil {
		return err
	}
	if err := <-profiled; err != nil {
		return err
	}
	pid, err := proxyPID(cmd.Process.Pid)
	if err != nil {
		return err
	}
	rss := procstat.RSSKiB(pid)
	peak := procstat.PeakRSSKiB(pid)
	cpu0 := procstat.CPUTime(pid)
	select { // measuring an interval, not synchronising
	case <-time.After(idle):
	case <-ctx.Done():
		return ctx.Err()
	}
	idleCPU := (procstat.CPUTime(pid) - cpu0).Seconds() / idle.Seconds() * 100
	rssIdle := procstat.RSSKiB(pid)

	var lat []time.Duration
	for i := range nChanges {
		name := fmt.Sprintf("change%d", i)
		ip := netip.AddrFrom4([4]byte{10, 96, 250, byte(i + 1)})
		t0 := time.Now()
		if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(oneService(name, ip, bed.Pods[0].IP)), 0o644); err != nil {
			return err
		}
		if err := testbed.Eventually(ctx, 60*time.Second, 5*time.Millisecond, func() error {
			_, err := testbed.Who(bed.Client, netip.AddrPortFrom(ip, 80), 200*time.Millisecond)
			return err
		}); err != nil {
			return fmt.Errorf("change %d never worked: %w", i, err)
		}
		lat = append(lat, time.Since(t0))
	}
	fmt.Printf("service ports: %d, endpoints: %d\n", nServices, nServices*nEndpoints)
	fmt.Printf("cold start to all portals programmed: %v\n", cold.Round(time.Millisecond))
	fmt.Printf("CPU until then: %v (proxy %v, the iptables commands it ran %v)\n", (coldSelf + coldChildren).Round(time.Millisecond),
		coldSelf.Round(time.Millisecond), coldChildren.Round(time.Millisecond))
	fmt.Printf("RSS with everything loaded: %.1f MiB right after the initial sync, %.1f MiB after the idle period; peak %.1f MiB\n",
		float64(rss)/1024, float64(rssIdle)/1024, float64(peak)/1024)
	fmt.Printf("idle CPU over %v: %.2f%% of one core\n", idle, idleCPU)
	fmt.Printf("network programming latency (file change -> traffic works), %d samples: %v\n", len(lat), lat)
	if !restart || nChanges == 0 {
		return nil
	}
	if snapshotFile != "" {
		// The snapshot is written at most once a second: a crash right after a change finds
		// the state before it. Measure the restart with the probed service in the snapshot.
		probed := service.ServicePortName{Namespace: "bench", Name: "change0", Port: "http"}
		if err := testbed.Eventually(ctx, 30*time.Second, 50*time.Millisecond, func() error {
			data, err := os.ReadFile(snapshotFile)
			if err != nil {
				return fmt.Errorf("no snapshot yet: %w", err)
			}
			st, err := snapshot.Decode(data)
			if err != nil {
				return err
			}
			for _, p := range st.Ports {
				if p.Name == probed && len(p.Internal) > 0 {
					return nil
				}
			}
			return fmt.Errorf("%s not in the snapshot yet", probed)
		}); err != nil {
			return err
		}
	}
	probe := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 250, 1}), 80)
	if restarts.runs > 0 {
		cmd, err = restartRuns(ctx, bed, probe, restarts, cmd, func() (*exec.Cmd, *logWatch, error) { return startProxy(proxy, bed, dir) },
			func(t time.Time) error {
				if err := waitRules(ctx, bed, nServices); err != nil {
					return err
				}
				if snapshotFile == "" {
					return nil
				}
				return waitSnapshotSince(ctx, snapshotFile, t)
			})
		return err
	}
	// A client connects in a loop through the first change's cluster IP (a real pod behind it)
	// while the proxy is SIGKILLed and started again at once.
	w, err := restartWindow(ctx, bed, func(s *split) error {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		s.reaped = time.Now()
		cmd, s.serving, err = startProxy(proxy, bed, dir)
		s.started = time.Now()
		return err
	}, netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 250, 1}), 80))
	if err != nil {
		return err
	}
	fmt.Printf("SIGKILL and immediate restart: %d of %d connections failed, failures spanning %v; first success %v after the kill; slowest successful connection %v\n",
		w.failed, w.attempts, w.window.Round(time.Millisecond), w.recovered.Round(time.Millisecond), w.slowest.Round(time.Millisecond))
	fmt.Printf("SIGKILL and immediate restart as a client sees it (one connection every %v): last answer before the kill -> first answer after it: %v\n%s",
		probeEvery, w.gap.Round(time.Millisecond), w.split)
	return nil
}

// startProxy starts the proxy binary in the node namespace on the services directory, with env
// (KEY=VALUE) added to the environment.
func startProxy(proxy string, bed *testbed.Bed, dir string, env ...string) (*exec.Cmd, *logWatch, error) {
	profiling, err := profilingConfig()
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command("ip", "netns", "exec", bed.Node.Name, proxy, "--services-file", dir, "--config", profiling,
		"--healthz-bind-address", "", "--metrics-bind-address", "127.0.0.1:10249", "--log-level", logLevel,
		"--iptables-min-sync-period", "100ms", "--services-file-check-period", "200ms",
		"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0")
	if snapshotFile != "" {
		cmd.Args = append(cmd.Args, "--restart-snapshot-file", snapshotFile)
	}
	if restarts.handoverSocket != "" {
		cmd.Args = append(cmd.Args, "--handover-socket", restarts.handoverSocket)
	}
	serving := newLogWatch(os.Stderr, servingMessage)
	cmd.Stdout, cmd.Stderr = os.Stderr, serving
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	return cmd, serving, cmd.Start()
}

type window struct {
	attempts, failed           int
	window, recovered, slowest time.Duration
	// gap is what a user measures: from the last answer before the kill to the first answer
	// after it (the greeting of the pod, read through the service).
	gap time.Duration
	// split is where the time after the kill went.
	split split
}

// probeEvery is the restart probe's pace: a client connecting in a loop, one attempt every 10 ms.
const probeEvery = 10 * time.Millisecond

// restartWindow has a client connect to addr every probeEvery, for 0.5 s before restart and on
// after it, each attempt bounded by 10 s (so a connection the new process holds until its
// endpoints are in counts as slow, not failed), and reports the span of failed attempts, the
// slowest successful one, how long after the kill the first attempt succeeded, and the gap between
// the last answer before the kill and the first after it. It stops 1 s after traffic is back, and
// not before the restarted proxy has settled (split.settled, set by restart, yields; its slow
// attempts until then are in split.slow too), at most 2 minutes after the kill.
func restartWindow(ctx context.Context, bed *testbed.Bed, restart func(*split) error, addr netip.AddrPort) (window, error) {
	var w window
	tick := time.NewTicker(probeEvery)
	defer tick.Stop()
	var lastAnswer time.Time
	for t0 := time.Now(); time.Since(t0) < 500*time.Millisecond; {
		select {
		case <-ctx.Done():
			return w, ctx.Err()
		case <-tick.C:
		}
		if _, err := testbed.Who(bed.Client, addr, 2*time.Second); err != nil {
			return w, fmt.Errorf("before the kill: %w", err)
		}
		lastAnswer = time.Now()
	}
	killed := time.Now()
	w.split.killed = killed
	if err := restart(&w.split); err != nil {
		return w, err
	}
	var firstFail, lastFail time.Time
	var back time.Time
	settled := w.split.settled == nil
	for time.Since(killed) < 2*time.Minute && (back.IsZero() || time.Since(back) < time.Second || !settled) {
		select {
		case <-ctx.Done():
			return w, ctx.Err()
		case err := <-w.split.settled:
			if err != nil {
				return w, fmt.Errorf("the restarted proxy: %w", err)
			}
			settled, w.split.settled = true, nil
			w.split.settledAt = time.Now()
			continue
		case <-tick.C:
		}
		t0 := time.Now()
		_, err := testbed.Who(bed.Client, addr, 10*time.Second)
		w.attempts++
		if took := time.Since(t0); err != nil || took > slowAttempt {
			w.split.slow = append(w.split.slow, attempt{start: t0, took: took, err: err})
		}
		if err != nil {
			w.failed++
			if firstFail.IsZero() {
				firstFail = t0
			}
			lastFail = time.Now()
			back = time.Time{}
			continue
		}
		w.slowest = max(w.slowest, time.Since(t0))
		if back.IsZero() {
			back = time.Now()
			if w.recovered == 0 {
				w.recovered = back.Sub(killed)
				w.gap = back.Sub(lastAnswer)
			}
		}
	}
	if back.IsZero() {
		return w, errors.New("traffic never came back after the restart")
	}
	if w.failed > 0 {
		w.window = lastFail.Sub(firstFail)
	}
	return w, nil
}

func clusterIP(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})
}

func bulkManifests(n, eps int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "apiVersion: v1\nkind: Service\nmetadata: {name: s%d, namespace: bulk}\nspec: {clusterIP: %s, ports: [{name: http, port: 80}]}\n---\n", i, clusterIP(i))
		fmt.Fprintf(&b, "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s%d-1, namespace: bulk, labels: {kubernetes.io/service-name: s%d}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n", i, i)
		for e := range eps {
			fmt.Fprintf(&b, "- addresses: [\"10.245.%d.%d\"]\n", (i*eps+e)/250%250, (i*eps+e)%250+1)
		}
		b.WriteString("---\n")
	}
	return b.String()
}

func oneService(name string, ip, pod netip.Addr) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: bench}
spec: {clusterIP: %[2]s, ports: [{name: http, port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: %[1]s-1, namespace: bench, labels: {kubernetes.io/service-name: %[1]s}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: ["%[3]s"]
`, name, ip, pod)
}

// waitPortal waits until a connection to addr from the client is accepted: the portal of that
// service port is in force and its socket listens. The initial sync programs every portal in one
// restore per table, so one working portal means all of them. Cheap enough to try every 10 ms
// (scraping /metrics that often, with 10,000 service ports' series, inflated the proxy's heap and
// polling iptables-save competed for the CPU the proxy was waiting for).
func waitPortal(ctx context.Context, bed *testbed.Bed, addr netip.AddrPort) (time.Time, error) {
	var at time.Time
	err := testbed.Eventually(ctx, 10*time.Minute, 10*time.Millisecond, func() error {
		c, err := testbed.Dial(bed.Client, addr, 100*time.Millisecond)
		if err != nil {
			return err
		}
		at = time.Now()
		return c.Close()
	})
	return at, err
}

// waitRules waits until the node's nat table holds a portal rule per service port (two chains).
func waitRules(ctx context.Context, bed *testbed.Bed, n int) error {
	return waitRulesFor(ctx, bed, n, 10*time.Minute)
}

func waitRulesFor(ctx context.Context, bed *testbed.Bed, n int, limit time.Duration) error {
	return testbed.Eventually(ctx, limit, 250*time.Millisecond, func() error {
		out, err := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
		if err != nil {
			return err
		}
		if got := strings.Count(string(out), "-A KUBE-PORTALS-CONTAINER"); got < n {
			return fmt.Errorf("%d of %d portal rules", got, n)
		}
		return nil
	})
}

// proxyPID finds the proxy under `ip netns exec` (which execs it, so usually the same PID).
func proxyPID(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return 0, err
	}
	if c := strings.TrimSpace(string(b)); c != "kube-portal-pro" && !strings.HasPrefix(c, "kube-proxy") {
		return 0, fmt.Errorf("pid %d is %q, not the proxy", pid, strings.TrimSpace(string(b)))
	}
	return pid, nil
}

// profile is what -cpuprofile and -trace ask for.
var profile struct {
	cpu, trace, heap string
	length           time.Duration
}

// profileStart fetches a CPU profile or an execution trace of the cold start from the proxy's
// /debug/pprof, as soon as its metrics address answers (the first few milliseconds of the process
// are missed). The channel yields the outcome once the file is written (at once when neither was
// asked for).
func profileStart(ctx context.Context, bed *testbed.Bed) <-chan error {
	done := make(chan error, 1)
	path, file := "", ""
	switch {
	case profile.cpu != "":
		path, file = fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(profile.length.Seconds())), profile.cpu
	case profile.trace != "":
		path, file = fmt.Sprintf("/debug/pprof/trace?seconds=%d", int(profile.length.Seconds())), profile.trace
	default:
		done <- nil
		return done
	}
	go func() {
		// Polled every 10 ms for at most a minute until the listener is up.
		out, err := bed.Node.Exec(ctx, "timeout", "60", "sh", "-c",
			`until curl -sf -o "$1" "$2"; do sleep 0.01; done`, "sh", file, "http://127.0.0.1:10249"+path)
		if err != nil {
			err = fmt.Errorf("profile: %w: %s", err, out)
		}
		done <- err
	}()
	return done
}

// profilingConfig writes a --config file that only turns pprof on (enableProfiling), which the
// profiles (-cpuprofile, -trace, -heapprofile) fetch from the proxy. A file rather than
// --profiling: builds from before that flag accept the field too, so a -baseline binary of
// either age starts. The path is fixed and the content constant: runs share it.
func profilingConfig() (string, error) {
	path := filepath.Join(os.TempDir(), "kpp-scale-profiling.conf")
	conf := "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nenableProfiling: true\n"
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		return "", fmt.Errorf("profiling config: %w", err)
	}
	return path, nil
}
