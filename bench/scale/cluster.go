package main

// cluster.go is -cluster: the same cold start with the proxy reading a real API server (etcd +
// kube-apiserver from e2e/framework on the root namespace's loopback, reached from the node
// namespace through framework's relay) instead of a services file.

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// listedMessage is the daemon's info line once both informers' initial lists are in its caches.
const listedMessage = "Informers' initial lists done"

// clusterOptions are -cluster's settings.
type clusterOptions struct {
	services, endpoints, workers, rounds int
	churnRate                            int
	churn                                time.Duration
	logDir                               string // each target's log, per round
	// restarts, when restarts.runs > 0, restarts each kube-portal-proxy target after its cold
	// start (restarts.go), with --restart-snapshot-file (and --handover-socket with -planned).
	restarts restartOptions
	// startLimit bounds a cold start; a target not in force by then is recorded as such and
	// skipped in later rounds (kube-proxy's iptables mode at 10,000 ports on iptables-nft).
	startLimit time.Duration
}

// clusterRun is one target's round: a cold start, then a churn period.
type clusterRun struct {
	listed, inForce   time.Duration // from process start; listed 0 when the target does not log it
	cpuSelf, cpuChild time.Duration
	rssKiB, peakKiB   int64
	allRules          time.Duration // from process start until every rule was seen (polled every 250 ms)
	incomplete        string        // why not every rule was in force 30 s after the probe service worked
	noStart           bool          // the probe service did not work within the start limit
	load              float64       // 1-minute load average at the start

	churned              bool
	churn                churnResult
	churnCPU             time.Duration // proxy + the commands it ran, over the churn period and its drain
	drain                time.Duration // after the period, until the target had observed its changes
	churnRSSKiB          int64         // RSS at the end of the churn (steady)
	churnPeakKiB         int64         // VmHWM at the end of the churn
	sliP50, sliP99, sliN float64       // the target's own network_programming_duration_seconds over the churn: the upper bound of the bucket holding p50, p99
}

// runCluster starts the control plane, creates the objects once, then runs each target (round
// robin, rounds times) in a fresh node namespace each time, so the targets are compared in one run
// on the same API server and objects.
func runCluster(ctx context.Context, targets []target, o clusterOptions) (err error) {
	startCtx, cancel := context.WithTimeout(ctx, framework.DefaultStartTimeout)
	cp, err := framework.Start(startCtx, framework.Options{})
	cancel()
	if err != nil {
		return fmt.Errorf("control plane: %w", err)
	}
	defer func() { err = errors.Join(err, cp.Stop()) }()

	t0 := time.Now()
	if err := createBulk(ctx, cp, o.services, o.endpoints, o.workers); err != nil {
		return err
	}
	created := time.Since(t0)
	fmt.Printf("cluster mode: service ports: %d, endpoints: %d; load average %s\n", o.services, o.services*o.endpoints, loadavg())
	fmt.Printf("creating %d Services + %d EndpointSlices with %d workers: %v (%.0f objects/s)\n", o.services, o.services, o.workers,
		created.Round(time.Millisecond), float64(2*o.services)/created.Seconds())
	for _, t := range targets {
		fmt.Printf("target %s: %s %s (minimum sync period %v)\n", t.name, t.bin, t.mode, t.minSync)
	}
	if o.logDir, err = os.MkdirTemp("", "kpp-scale-logs-"); err != nil {
		return err
	}
	fmt.Printf("targets' logs: %s\n", o.logDir)
	cfg := cp.AdminConfig()
	cfg.QPS, cfg.Burst = -1, 0
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ch := &churner{c: client, n: o.services, eps: o.endpoints, probeIdx: o.services - 2}

	results := make([][]clusterRun, len(targets))
	gaveUp := make([]bool, len(targets))
	for round := range o.rounds {
		// The order rotates each round: the first target of a round meets an API server still
		// busy with the object creation or the last target's churn.
		for k := range targets {
			i := (k + round) % len(targets)
			t := targets[i]
			if gaveUp[i] {
				continue
			}
			r, err := runTarget(ctx, cp, ch, t, round+1, o)
			if err != nil {
				return fmt.Errorf("%s, round %d: %w", t.name, round+1, err)
			}
			results[i] = append(results[i], r)
			printRun(t, round+1, r, o.churn)
			if r.noStart {
				gaveUp[i] = true
				fmt.Printf("    %s: not in force %v after its start; not run again\n", t.name, o.startLimit)
			}
		}
	}
	printSummary(targets, results, o)
	return nil
}

// runTarget is one round of one target: a cold start in a fresh node namespace, then (with
// -churn) the churn period.
func runTarget(ctx context.Context, cp *framework.ControlPlane, ch *churner, t target, round int, o clusterOptions) (r clusterRun, err error) {
	bed, closeBed, err := testbed.Start(ctx, probePods, 8080, 5353)
	defer func() { err = errors.Join(err, closeBed()) }()
	if err != nil {
		return r, err
	}
	dir, err := os.MkdirTemp("", "kpp-scale-cluster-")
	if err != nil {
		return r, err
	}
	defer os.RemoveAll(dir)
	server, err := url.Parse(cp.Server)
	if err != nil {
		return r, err
	}
	rl, err := framework.StartRelay(bed.Node, server.Host)
	if err != nil {
		return r, err
	}
	defer rl.Close()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := framework.WriteRelayedKubeconfig(cp.ProxyKubeconfig, kubeconfig, "https://"+rl.Addr()); err != nil {
		return r, err
	}
	restarting := o.restarts.runs > 0 && !t.kubeProxy()
	command := func() (*exec.Cmd, error) {
		c, err := t.command(bed, kubeconfig, dir)
		if err != nil || !restarting {
			return c, err
		}
		c.Args = append(c.Args, "--restart-snapshot-file", filepath.Join(dir, "restart-snapshot"))
		if o.restarts.planned {
			c.Args = append(c.Args, "--handover-socket", filepath.Join(dir, "handover.sock"))
		}
		return c, nil
	}
	cmd, err := command()
	if err != nil {
		return r, err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return r, err
	}
	cmd.Stdout = os.Stderr
	r.load = load1()
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return r, err
	}
	defer func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() }()
	logFile, err := os.Create(filepath.Join(o.logDir, fmt.Sprintf("%s-%d.log", t.name, round)))
	if err != nil {
		return r, err
	}
	defer logFile.Close()
	listed := watchLog(io.TeeReader(stderr, logFile), listedMessage)
	profiled := profileStart(ctx, bed)

	// The probe service's endpoints are the bed's pods, so it works through kube-proxy's DNAT as
	// through the daemon's portal; each target programs every service in one transaction (the
	// daemon: one restore per table), so the probe working marks the end of the first sync.
	vip := netip.AddrPortFrom(apiClusterIP(o.services-1), 80)
	synced, err := waitWorks(ctx, bed, vip, o.startLimit)
	if err != nil && ctx.Err() == nil {
		// Still programming (or stuck): what it cost so far, and no churn.
		r.noStart, r.incomplete = true, err.Error()
		r.cpuSelf, r.cpuChild = procstat.OwnCPUTime(cmd.Process.Pid)
		if pid, err := proxyPID(cmd.Process.Pid); err == nil {
			r.rssKiB, r.peakKiB = ownRSSKiB(pid), procstat.PeakRSSKiB(pid)
		}
		<-profiled
		return r, nil
	}
	if err != nil {
		return r, err
	}
	r.cpuSelf, r.cpuChild = procstat.OwnCPUTime(cmd.Process.Pid)
	r.inForce = synced.Sub(start)
	select { // the line comes before the first sync: read by now, or never (an older binary)
	case at := <-listed:
		r.listed = at.Sub(start)
	default:
	}
	// A proxy that synced part of the initial lists may never catch up: record it and go on.
	if err := testbed.Eventually(ctx, 30*time.Second, 250*time.Millisecond, func() error {
		return t.rulesInForce(ctx, bed, o.services, o.services*o.endpoints)
	}); err != nil {
		if ctx.Err() != nil {
			return r, err
		}
		r.incomplete = err.Error()
	} else {
		r.allRules = time.Since(start)
	}
	if err := <-profiled; err != nil {
		return r, err
	}
	pid, err := proxyPID(cmd.Process.Pid)
	if err != nil {
		return r, err
	}
	r.rssKiB, r.peakKiB = ownRSSKiB(pid), procstat.PeakRSSKiB(pid)
	if profile.heap != "" && round == 1 && !t.kubeProxy() {
		// What the live heap holds once everything is in force (first round of each daemon).
		file := strings.TrimSuffix(profile.heap, ".pb.gz") + "-" + t.name + ".pb.gz"
		if out, err := bed.Node.Exec(ctx, "curl", "-sf", "-o", file, "http://"+metricsAddr+"/debug/pprof/heap"); err != nil {
			return r, fmt.Errorf("heap profile: %w: %s", err, out)
		}
	}
	if restarting {
		fmt.Printf("%s, round %d: restarts\n", t.name, round)
		if err := waitSnapshotSince(ctx, filepath.Join(dir, "restart-snapshot"), start); err != nil {
			return r, err
		}
		cmd, err = restartRuns(ctx, bed, vip, o.restarts, cmd, func() (*exec.Cmd, *logWatch, error) {
			c, err := command()
			if err != nil {
				return nil, nil, err
			}
			serving := newLogWatch(logFile, servingMessage)
			c.Stdout, c.Stderr = logFile, serving
			return c, serving, c.Start()
		}, func(at time.Time) error {
			if err := testbed.Eventually(ctx, 2*time.Minute, 250*time.Millisecond, func() error {
				return t.rulesInForce(ctx, bed, o.services, o.services*o.endpoints)
			}); err != nil {
				return err
			}
			return waitSnapshotSince(ctx, filepath.Join(dir, "restart-snapshot"), at)
		})
		if err != nil {
			return r, err
		}
		if pid, err = proxyPID(cmd.Process.Pid); err != nil {
			return r, err
		}
	}
	if o.churn <= 0 {
		return r, nil
	}

	before, err := scrapeSLI(ctx, bed)
	if err != nil {
		return r, err
	}
	cpu0 := cpuSpent(pid)
	r.churn, err = ch.run(ctx, bed, netip.AddrPortFrom(apiClusterIP(ch.probeIdx), 80), podIPs(), o.churnRate, o.churn)
	if err != nil {
		return r, err
	}
	r.churnRSSKiB, r.churnPeakKiB = ownRSSKiB(pid), procstat.PeakRSSKiB(pid)
	// A target may still be working through the changes when the period ends (kube-proxy at
	// 10,000 ports on a loaded machine): wait, at most drainLimit, until it has observed as many
	// programming latencies as changes were made, so the SLI and the CPU include that backlog.
	want := float64(r.churn.sent-r.churn.failed+len(r.churn.probes)+r.churn.lost) * 0.98
	var after histogram
	drainStart := time.Now()
	for {
		if after, err = scrapeSLI(ctx, bed); err != nil {
			return r, err
		}
		if after.sub(before).count() >= want || time.Since(drainStart) > drainLimit {
			break
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(time.Second): // polling the target's metrics
		}
	}
	r.drain = time.Since(drainStart)
	r.churnCPU = cpuSpent(pid) - cpu0
	d := after.sub(before)
	r.sliP50, r.sliP99, r.sliN = d.bucketOf(0.5), d.bucketOf(0.99), d.count()
	r.churned = true
	return r, nil
}

// drainLimit bounds the wait for a target to catch up with the churn.
const drainLimit = 2 * time.Minute

// cpuSpent is the CPU pid has used with its children: its own, that of the children it waited
// for, and that of those still running (an nft transaction in progress).
func cpuSpent(pid int) time.Duration {
	_, waited := procstat.OwnCPUTime(pid)
	return waited + procstat.CPUTime(pid)
}

// ownRSSKiB is pid's own VmRSS: procstat.RSSKiB sums the tree, which for kube-proxy would add an
// nft or iptables-restore child caught running.
func ownRSSKiB(pid int) int64 { return procstat.StatusKiB(pid, "VmRSS") }

// probePods is how many pods each bed serves: the probe service's endpoints.
const probePods = 5

func podIPs() []netip.Addr {
	var out []netip.Addr
	for i := 1; i <= probePods; i++ {
		out = append(out, testbed.PodIP(i))
	}
	return out
}

// waitWorks waits until a connection to addr from the client is answered by a pod.
func waitWorks(ctx context.Context, bed *testbed.Bed, addr netip.AddrPort, limit time.Duration) (time.Time, error) {
	var at time.Time
	err := testbed.Eventually(ctx, limit, 10*time.Millisecond, func() error {
		if _, err := testbed.Who(bed.Client, addr, 100*time.Millisecond); err != nil {
			return err
		}
		at = time.Now()
		return nil
	})
	return at, err
}

func printRun(t target, round int, r clusterRun, churn time.Duration) {
	fmt.Printf("%s round %d (load %.2f): lists done %v, probe service works %v, every rule seen %v; CPU %v (proxy %v, children %v); RSS %.1f MiB, peak %.1f MiB\n",
		t.name, round, r.load, r.listed.Round(time.Millisecond), r.inForce.Round(time.Millisecond), r.allRules.Round(time.Millisecond),
		(r.cpuSelf + r.cpuChild).Round(time.Millisecond), r.cpuSelf.Round(time.Millisecond), r.cpuChild.Round(time.Millisecond),
		float64(r.rssKiB)/1024, float64(r.peakKiB)/1024)
	if r.incomplete != "" {
		fmt.Printf("    INCOMPLETE: %s\n", r.incomplete)
	}
	if r.churned {
		c := r.churn
		fmt.Printf("    churn: %d changes (%d failed, %d ticks dropped), %d probes (%d lost): p50 %v p99 %v max %v; SLI %.0f samples p50 <= %gs p99 <= %gs; caught up %v after the period; CPU %v (%.2f s/min); RSS %.1f MiB, peak %.1f MiB\n",
			c.sent, c.failed, c.dropped, len(c.probes), c.lost, quantile(c.probes, 0.5).Round(time.Millisecond), quantile(c.probes, 0.99).Round(time.Millisecond),
			quantile(c.probes, 1).Round(time.Millisecond), r.sliN, r.sliP50, r.sliP99, r.drain.Round(time.Second), r.churnCPU.Round(10*time.Millisecond),
			r.churnCPU.Seconds()*60/churn.Seconds(), float64(r.churnRSSKiB)/1024, float64(r.churnPeakKiB)/1024)
	}
}

// printSummary prints one markdown table: per target, the medians over the rounds.
func printSummary(targets []target, results [][]clusterRun, o clusterOptions) {
	fmt.Printf("\nmedians of %d rounds, %d service ports, %d endpoints; load average now %s\n\n", o.rounds, o.services, o.services*o.endpoints, loadavg())
	row := func(label string, f func(clusterRun) string) {
		fmt.Printf("| %s |", label)
		for i := range targets {
			fmt.Printf(" %s |", f2(results[i], f))
		}
		fmt.Println()
	}
	fmt.Print("| |")
	for _, t := range targets {
		fmt.Printf(" %s |", t.name)
	}
	fmt.Print("\n| --- |")
	for range targets {
		fmt.Print(" --- |")
	}
	fmt.Println()
	dur := func(f func(clusterRun) time.Duration) func(clusterRun) string {
		return func(r clusterRun) string { return fmtDur(f(r)) }
	}
	row("load average (1 min) at start", func(r clusterRun) string { return fmt.Sprintf("%.2f", r.load) })
	row("process start -> initial lists done", dur(func(r clusterRun) time.Duration { return r.listed }))
	row("process start -> probe service works (cold start)", func(r clusterRun) string {
		if r.noStart {
			return fmt.Sprintf(">%v", o.startLimit)
		}
		return fmtDur(r.inForce)
	})
	row("process start -> every rule seen (polled 250 ms)", dur(func(r clusterRun) time.Duration { return r.allRules }))
	row("CPU to cold start (proxy + children)", dur(func(r clusterRun) time.Duration { return r.cpuSelf + r.cpuChild }))
	row("RSS after the cold start (MiB)", func(r clusterRun) string { return fmt.Sprintf("%.1f", float64(r.rssKiB)/1024) })
	row("peak RSS over the cold start (MiB)", func(r clusterRun) string { return fmt.Sprintf("%.1f", float64(r.peakKiB)/1024) })
	if o.churn <= 0 {
		return
	}
	row(fmt.Sprintf("churn %d/s for %v: probe p50", o.churnRate, o.churn), dur(func(r clusterRun) time.Duration { return quantile(r.churn.probes, 0.5) }))
	row("churn: probe p99", dur(func(r clusterRun) time.Duration { return quantile(r.churn.probes, 0.99) }))
	row("churn: probes (lost)", func(r clusterRun) string { return fmt.Sprintf("%d (%d)", len(r.churn.probes), r.churn.lost) })
	row("churn: SLI p50, bucket (s, <=)", func(r clusterRun) string { return fmt.Sprintf("%g", r.sliP50) })
	row("churn: SLI p99, bucket (s, <=)", func(r clusterRun) string { return fmt.Sprintf("%g", r.sliP99) })
	row("churn: SLI samples", func(r clusterRun) string { return fmt.Sprintf("%.0f", r.sliN) })
	row("churn: caught up after the period", dur(func(r clusterRun) time.Duration { return r.drain }))
	row("churn: CPU s per minute of churn (period + catch-up)", func(r clusterRun) string { return fmt.Sprintf("%.2f", r.churnCPU.Seconds()*60/o.churn.Seconds()) })
	row("RSS at the end of the churn (steady, MiB)", func(r clusterRun) string { return fmt.Sprintf("%.1f", float64(r.churnRSSKiB)/1024) })
	row("peak RSS, start + churn (MiB)", func(r clusterRun) string { return fmt.Sprintf("%.1f", float64(r.churnPeakKiB)/1024) })
}

// f2 is the median of f over the rounds (by the numeric value f prints), with every round's value
// in brackets.
func f2(rs []clusterRun, f func(clusterRun) string) string {
	var vals []string
	type kv struct {
		v float64
		s string
	}
	var sorted []kv
	for _, r := range rs {
		s := f(r)
		vals = append(vals, s)
		v, _ := strconv.ParseFloat(strings.Fields(strings.TrimSuffix(strings.TrimSuffix(s, "ms"), "s"))[0], 64)
		if strings.HasSuffix(s, "ms") {
			v /= 1000
		}
		sorted = append(sorted, kv{v, s})
	}
	if len(sorted) == 0 {
		return "-"
	}
	slices.SortFunc(sorted, func(a, b kv) int { return cmp.Compare(a.v, b.v) })
	med := sorted[len(sorted)/2].s
	if len(rs) == 1 {
		return med
	}
	return fmt.Sprintf("%s (%s)", med, strings.Join(vals, ", "))
}

func fmtDur(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	if d < time.Second {
		return fmt.Sprintf("%dms", d.Milliseconds())
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}

// loadavg is /proc/loadavg's three figures.
func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func load1() float64 {
	v, _ := strconv.ParseFloat(strings.Fields(loadavg() + " 0")[0], 64)
	return v
}

// klogInfo matches client-go's info lines (klog: "I1123 16:11:02.377184 ...").
var klogInfo = regexp.MustCompile(`^I\d{4} `)

// watchLog copies the proxy's log to our stderr (all but its and client-go's info lines) and yields the time the
// first line holding msg was read.
func watchLog(r io.Reader, msg string) <-chan time.Time {
	at := make(chan time.Time, 1)
	go func() {
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		seen := false
		for sc.Scan() {
			line := sc.Text()
			if !seen && strings.Contains(line, msg) {
				at <- time.Now()
				seen = true
			}
			if !strings.Contains(line, "level=info") && !klogInfo.MatchString(line) {
				fmt.Fprintln(os.Stderr, line)
			}
		}
		_, _ = io.Copy(io.Discard, r)
	}()
	return at
}

// createBulk creates node nodeName, and namespace bulk with n Services (apiClusterIP) and an
// EndpointSlice of eps endpoints for each, with workers concurrent requests and no client-side
// rate limit. The last service's endpoints are the beds' pods (the probe service).
func createBulk(ctx context.Context, cp *framework.ControlPlane, n, eps, workers int) error {
	cfg := cp.AdminConfig()
	cfg.QPS, cfg.Burst = -1, 0 // no client-side rate limit: the API server's own limits apply
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bulk"}},
		metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("namespace bulk: %w", err)
	}
	// The node the targets run on, with the node namespace's address (kube-proxy waits for it).
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: testbed.NodeClientIP.String()}}}}
	if _, err := c.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("node %s: %w", nodeName, err)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, workers)
	for w := range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				if err := createOne(ctx, c, i, eps, n-1); err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func createOne(ctx context.Context, c kubernetes.Interface, i, eps, probe int) error {
	name := fmt.Sprintf("s%d", i)
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "bulk"},
		Spec: corev1.ServiceSpec{ClusterIP: apiClusterIP(i).String(),
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}},
	}
	if _, err := c.CoreV1().Services("bulk").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("service bulk/%s: %w", name, err)
	}
	slice := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-1", Namespace: "bulk",
			Labels: map[string]string{discovery.LabelServiceName: name}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	for e, addr := range bulkEndpoints(i, eps) {
		if i == probe { // the cold start's probe service: the bed's pods, so traffic through it works
			addr = testbed.PodIP(e%probePods + 1).String()
		}
		slice.Endpoints = append(slice.Endpoints, discovery.Endpoint{
			Addresses:  []string{addr},
			Conditions: discovery.EndpointConditions{Ready: ptr.To(true)},
		})
	}
	if _, err := c.DiscoveryV1().EndpointSlices("bulk").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("endpointslice bulk/%s-1: %w", name, err)
	}
	return nil
}

// bulkEndpoints are the addresses of bulk service i's eps endpoints (nothing listens on them).
func bulkEndpoints(i, eps int) []string {
	var out []string
	for e := range eps {
		k := i*eps + e
		out = append(out, fmt.Sprintf("10.245.%d.%d", k/250%250, k%250+1))
	}
	return out
}

// apiClusterIP is the file mode's clusterIP moved up 100 /24s, clear of the API server's own
// kubernetes Service (10.96.0.1); for up to 38,750 service ports.
func apiClusterIP(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 96, byte(100 + i/250), byte(i%250 + 1)})
}
