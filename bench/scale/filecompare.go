package main

// filecompare.go is file mode with -baseline: the daemon (-proxy) and other binaries in turn on
// the same services file, a cold start each (order rotating every round), for side-by-side
// memory and cold-start figures without an API server: RSS after the cold start and its peak, the
// live heap (after a forced GC), the goroutine stacks, then a churn of endpoint changes (files
// rewritten) and the RSS and peak after it.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// churnFiles is how many small files (one Service and its slice each) the churn rewrites.
const churnFiles = 50

// fileRun is one binary's round.
type fileRun struct {
	load                   float64
	cold                   time.Duration
	cpuSelf, cpuChild      time.Duration
	rssKiB, peakKiB        int64
	heapLive, stacks       float64 // bytes: heap after a forced GC, goroutine stacks
	goroutines             float64
	scrape                 time.Duration // one /metrics scrape (gzip, as Prometheus asks)
	scrapeAlloc            float64       // bytes it allocated
	churnRSSKiB, churnPeak int64
	churnCPU               time.Duration
	churnHeapLive          float64
	churnChanges           int
}

func compareFile(ctx context.Context, bins []string, nServices, nEndpoints, rounds int, churn time.Duration, churnRate int) error {
	dir, err := os.MkdirTemp("", "kpp-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.WriteFile(filepath.Join(dir, "bulk.yaml"), []byte(bulkManifests(nServices, nEndpoints)), 0o644); err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(1, 2))
	writeChurn := func(i int) error {
		ip := netip.AddrFrom4([4]byte{10, 97, byte(i / 250), byte(i%250 + 1)})
		pod := netip.AddrFrom4([4]byte{10, 246, byte(rng.IntN(250)), byte(rng.IntN(250) + 1)})
		return os.WriteFile(filepath.Join(dir, fmt.Sprintf("churn%d.yaml", i)), []byte(oneService(fmt.Sprintf("churn%d", i), ip, pod)), 0o644)
	}
	for i := range churnFiles {
		if err := writeChurn(i); err != nil {
			return err
		}
	}
	results := make([][]fileRun, len(bins))
	for round := range rounds {
		for k := range bins {
			i := (k + round) % len(bins) // the order rotates each round
			// Fresh namespaces each time: the rules a daemon leaves behind would make the next
			// one's start a restart (it reopens the proxy ports they point at).
			bed, closeBed, err := testbed.Start(ctx, 1, 8080, 5353)
			if err != nil {
				return errors.Join(err, closeBed())
			}
			r, err := fileRound(ctx, bed, bins[i], dir, nServices, churn, churnRate, writeChurn,
				round == 0 && profile.heap != "", fmt.Sprint(i))
			err = errors.Join(err, closeBed())
			if err != nil {
				return fmt.Errorf("%s round %d: %w", bins[i], round+1, err)
			}
			results[i] = append(results[i], r)
			fmt.Fprintf(os.Stderr, "round %d %s: %+v\n", round+1, bins[i], r)
		}
	}
	fmt.Printf("%d service ports, %d endpoints, %d rounds (each round in brackets)\n", nServices, nServices*nEndpoints, rounds)
	rows := []struct {
		name string
		f    func(r fileRun) string
	}{
		{"load average at the start", func(r fileRun) string { return fmt.Sprintf("%.1f", r.load) }},
		{"cold start (process start -> last portal accepts)", func(r fileRun) string { return fmt.Sprintf("%.2f s", r.cold.Seconds()) }},
		{"CPU to the cold start, process + commands", func(r fileRun) string {
			return fmt.Sprintf("%.2f s", (r.cpuSelf + r.cpuChild).Seconds())
		}},
		{"RSS after the cold start / peak (VmHWM)", func(r fileRun) string {
			return fmt.Sprintf("%.1f / %.1f MiB", float64(r.rssKiB)/1024, float64(r.peakKiB)/1024)
		}},
		{"live heap after the cold start (forced GC)", func(r fileRun) string { return fmt.Sprintf("%.1f MB", r.heapLive/1e6) }},
		{"a /metrics scrape: time / allocated", func(r fileRun) string {
			return fmt.Sprintf("%.0f ms / %.1f MB", float64(r.scrape)/1e6, r.scrapeAlloc/1e6)
		}},
		{"goroutines / stacks", func(r fileRun) string { return fmt.Sprintf("%.0f / %.1f MB", r.goroutines, r.stacks/1e6) }},
		{"churn: changes, CPU", func(r fileRun) string {
			return fmt.Sprintf("%d, %.2f s", r.churnChanges, r.churnCPU.Seconds())
		}},
		{"RSS after the churn / peak", func(r fileRun) string {
			return fmt.Sprintf("%.1f / %.1f MiB", float64(r.churnRSSKiB)/1024, float64(r.churnPeak)/1024)
		}},
		{"live heap after the churn", func(r fileRun) string { return fmt.Sprintf("%.1f MB", r.churnHeapLive/1e6) }},
	}
	fmt.Printf("| | %s |\n| --- |%s\n", strings.Join(bins, " | "), strings.Repeat(" --- |", len(bins)))
	for _, row := range rows {
		if churn <= 0 && strings.Contains(row.name, "churn") {
			continue
		}
		cells := []string{row.name}
		for i := range bins {
			var each []string
			for _, r := range results[i] {
				each = append(each, row.f(r))
			}
			cells = append(cells, strings.Join(each, "; "))
		}
		fmt.Printf("| %s |\n", strings.Join(cells, " | "))
	}
	return nil
}

func fileRound(ctx context.Context, bed *testbed.Bed, bin, dir string, nServices int, churn time.Duration, churnRate int,
	writeChurn func(int) error, heapProfile bool, name string) (r fileRun, err error) {
	r.load = load1()
	var env []string
	if e, b, ok := strings.Cut(bin, "@"); ok {
		env, bin = strings.Split(e, ","), b
	}
	start := time.Now()
	cmd, _, err := startProxy(bin, bed, dir, env...)
	if err != nil {
		return r, err
	}
	defer func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() }()
	synced, err := waitPortal(ctx, bed, netip.AddrPortFrom(clusterIP(nServices-1), 80))
	if err != nil {
		return r, err
	}
	r.cold = synced.Sub(start)
	r.cpuSelf, r.cpuChild = procstat.OwnCPUTime(cmd.Process.Pid)
	if err := waitRules(ctx, bed, nServices); err != nil {
		return r, err
	}
	pid, err := proxyPID(cmd.Process.Pid)
	if err != nil {
		return r, err
	}
	r.rssKiB, r.peakKiB = ownRSSKiB(pid), procstat.PeakRSSKiB(pid)
	if heapProfile {
		file := strings.TrimSuffix(profile.heap, ".pb.gz") + "-" + name + ".pb.gz"
		if out, err := bed.Node.Exec(ctx, "curl", "-sf", "-o", file, "http://"+metricsAddr+"/debug/pprof/heap?gc=1"); err != nil {
			return r, fmt.Errorf("heap profile: %w: %s", err, out)
		}
	}
	m, err := scrapeGoMetrics(ctx, bed)
	if err != nil {
		return r, err
	}
	r.heapLive, r.stacks, r.goroutines = m["go_memstats_heap_alloc_bytes"], m["go_memstats_stack_inuse_bytes"], m["go_goroutines"]
	if r.scrape, r.scrapeAlloc, err = scrapeCost(ctx, bed); err != nil {
		return r, err
	}
	if churn <= 0 {
		return r, nil
	}
	cpu0 := procstat.CPUTime(pid)
	tick := time.NewTicker(time.Second / time.Duration(churnRate))
	defer tick.Stop()
	for end := time.Now().Add(churn); time.Now().Before(end); {
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-tick.C:
		}
		if err := writeChurn(r.churnChanges % churnFiles); err != nil {
			return r, err
		}
		r.churnChanges++
	}
	r.churnCPU = procstat.CPUTime(pid) - cpu0
	r.churnRSSKiB, r.churnPeak = ownRSSKiB(pid), procstat.PeakRSSKiB(pid)
	if heapProfile { // with the first, -diff_base shows what the churn allocated
		file := strings.TrimSuffix(profile.heap, ".pb.gz") + "-" + name + "-churn.pb.gz"
		if out, err := bed.Node.Exec(ctx, "curl", "-sf", "-o", file, "http://"+metricsAddr+"/debug/pprof/heap?gc=1"); err != nil {
			return r, fmt.Errorf("heap profile: %w: %s", err, out)
		}
	}
	m, err = scrapeGoMetrics(ctx, bed)
	if err != nil {
		return r, err
	}
	r.churnHeapLive = m["go_memstats_heap_alloc_bytes"]
	return r, nil
}

// scrapeGoMetrics forces a GC and reads the runtime's memory statistics right after it (the text
// heap profile ends with them), so HeapAlloc is the live heap, and the goroutine count: not from
// /metrics, whose 10,000 service ports' series would make garbage of their own.
func scrapeGoMetrics(ctx context.Context, bed *testbed.Bed) (map[string]float64, error) {
	out, err := bed.Node.Exec(ctx, "curl", "-sf", "http://"+metricsAddr+"/debug/pprof/heap?gc=1&debug=1")
	if err != nil {
		return nil, fmt.Errorf("forced GC: %w: %s", err, out)
	}
	m := map[string]float64{}
	for _, l := range strings.Split(string(out), "\n") {
		// "# Stack = <in use> / <from the OS>"
		for stat, name := range map[string]string{"HeapAlloc": "go_memstats_heap_alloc_bytes", "Stack": "go_memstats_stack_inuse_bytes"} {
			if v, ok := strings.CutPrefix(l, "# "+stat+" = "); ok {
				m[name], _ = strconv.ParseFloat(strings.Fields(v)[0], 64)
			}
		}
	}
	out, err = bed.Node.Exec(ctx, "curl", "-sf", "http://"+metricsAddr+"/debug/pprof/goroutine?debug=1")
	if err != nil {
		return nil, fmt.Errorf("goroutines: %w", err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	if v, ok := strings.CutPrefix(first, "goroutine profile: total "); ok {
		m["go_goroutines"], _ = strconv.ParseFloat(strings.TrimSpace(v), 64)
	}
	if len(m) != 3 {
		return nil, fmt.Errorf("runtime statistics: got %v", m)
	}
	return m, nil
}

// scrapeCost times a /metrics scrape (curl's own figure, without its start) and what the proxy
// allocated for one: go_memstats_alloc_bytes_total of the next scrape less this one's (a pprof
// read of the runtime's statistics would add its own garbage, several times a lean scrape's).
func scrapeCost(ctx context.Context, bed *testbed.Bed) (time.Duration, float64, error) {
	scrape := func() (secs, alloc float64, err error) {
		out, err := bed.Node.Exec(ctx, "curl", "-sf", "--compressed", "-w", "\n# scrape time %{time_total}\n", "http://"+metricsAddr+"/metrics")
		if err != nil {
			return 0, 0, fmt.Errorf("scrape /metrics: %w", err)
		}
		found := 0
		for _, l := range strings.Split(string(out), "\n") {
			if v, ok := strings.CutPrefix(l, "go_memstats_alloc_bytes_total "); ok {
				alloc, err = strconv.ParseFloat(strings.TrimSpace(v), 64)
				found++
			} else if v, ok := strings.CutPrefix(l, "# scrape time "); ok {
				secs, err = strconv.ParseFloat(strings.TrimSpace(v), 64)
				found++
			}
			if err != nil {
				return 0, 0, fmt.Errorf("scrape /metrics: %q: %w", l, err)
			}
		}
		if found != 2 {
			return 0, 0, fmt.Errorf("scrape /metrics: no go_memstats_alloc_bytes_total or time")
		}
		return secs, alloc, nil
	}
	secs, first, err := scrape()
	if err != nil {
		return 0, 0, err
	}
	_, next, err := scrape()
	if err != nil {
		return 0, 0, err
	}
	return time.Duration(secs * float64(time.Second)), next - first, nil
}
