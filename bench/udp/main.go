// Command udp is the side-by-side UDP benchmark of issue 4 (not run in CI): DNS-sized 64-byte
// request/response exchanges from concurrent clients to an echo endpoint, directly, through
// kube-portal-proxy's udp.Proxy and through nginx's stream module, in one run. It reports
// exchanges/s, the share of the direct rate, p50/p99 latency and the proxy's CPU per exchange
// (each exchange is two datagrams through the proxy). Loopback only; runs are bounded.
//
//	go run ./bench/udp [-clients 32] [-duration 2s] [-rounds 3] [-batches 1,8,32] [-compare other-build]
//
// The proxy and nginx run as child processes so that their CPU time (summed over all their
// threads from /proc/<pid>/task/*/schedstat) is measured alone; the echo endpoint is another child
// and the clients run in this process, the same for every target. Rounds rotate the order of the targets, and
// the table shows the median over the rounds of each figure, to even out a machine shared with
// other work.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

func main() {
	role := flag.String("role", "", "internal: run as the proxy or echo child")
	listen := flag.String("listen", "127.0.0.1:0", "internal: proxy child listen address")
	backend := flag.String("backend", "", "internal: proxy child endpoint")
	batch := flag.Int("batch", 0, "internal: proxy child recvmmsg/sendmmsg batch size")
	profile := flag.String("cpuprofile", "", "write the proxy child's CPU profile to this file")
	clients := flag.Int("clients", 32, "concurrent clients")
	size := flag.Int("size", 64, "request and response size in bytes")
	duration := flag.Duration("duration", 2*time.Second, "measured time per target and round")
	warmup := flag.Duration("warmup", 300*time.Millisecond, "unmeasured time before each measurement")
	rounds := flag.Int("rounds", 3, "rounds over all targets")
	batches := flag.String("batches", "1", "extra proxy rows with these recvmmsg/sendmmsg batch sizes (comma list)")
	compare := flag.String("compare", "", "another build of this command whose proxy child to add as a target (A/B)")
	nginxPath := flag.String("nginx", "/usr/sbin/nginx", "nginx binary; empty to skip nginx")
	flag.Parse()

	switch *role {
	case "proxy":
		if err := runProxyChild(*listen, *backend, *batch, *profile); err != nil {
			log.Fatal(err)
		}
		return
	case "echo":
		if err := runEchoChild(*listen); err != nil {
			log.Fatal(err)
		}
		return
	}
	if *duration > 30*time.Second || *rounds > 10 {
		log.Fatal("keep runs short: -duration <= 30s, -rounds <= 10")
	}
	ctx := context.Background()
	// The endpoint is a process of its own, as a pod is: a direct path inside one process would
	// hand datagrams between goroutines without the cross-process wake-ups every real path has.
	echoAddr, _, stopEcho, err := startChild(ctx, "", "-role", "echo", "-listen", "127.0.0.2:0")
	if err != nil {
		log.Fatal(err)
	}
	defer stopEcho()
	echo := struct{ addr netip.AddrPort }{echoAddr}

	targets := []target{
		directTarget(echo.addr),
		proxyTarget("proxy", "", echo.addr, 0, *profile),
	}
	for _, b := range strings.Split(*batches, ",") {
		if n, err := strconv.Atoi(strings.TrimSpace(b)); err == nil && n > 0 {
			targets = append(targets, proxyTarget("proxy -batch "+strconv.Itoa(n), "", echo.addr, n, ""))
		}
	}
	if *compare != "" {
		targets = append(targets, proxyTarget("proxy "+filepath.Base(*compare), *compare, echo.addr, 0, ""))
	}
	if *nginxPath != "" {
		targets = append(targets, nginxTarget(*nginxPath, echo.addr))
	}
	results := make(map[string][]result)
	for r := range *rounds {
		for i := range targets {
			t := targets[(i+r)%len(targets)]
			res, err := measure(ctx, t, *clients, *size, *warmup, *duration)
			if err != nil {
				log.Fatalf("%s: %v", t.name, err)
			}
			results[t.name] = append(results[t.name], res)
		}
	}
	printTable(targets, results, *clients, *size, *duration, *rounds)
}

// measure starts a target, loads it, and stops it.
func measure(ctx context.Context, t target, clients, size int, warmup, d time.Duration) (result, error) {
	addr, pid, stop, err := t.start(ctx)
	if err != nil {
		return result{}, err
	}
	defer stop()
	if err := probe(addr, size); err != nil {
		return result{}, fmt.Errorf("probe %s: %w", addr, err)
	}
	return load(addr, pid, clients, size, warmup, d)
}

func printTable(targets []target, results map[string][]result, clients, size int, d time.Duration, rounds int) {
	fmt.Printf("%d clients, %d-byte request/response, %d rounds of %s per target, median of the rounds for each figure\n",
		clients, size, rounds, d)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "target\texchanges/s\tof direct\tp50\tp99\tCPU µs/exchange\tlost\t")
	var direct float64
	for _, t := range targets {
		m := median(results[t.name])
		if t.name == "direct" {
			direct = m.rate
		}
		cpu := "-"
		if m.cpuPerExchange > 0 {
			cpu = fmt.Sprintf("%.1f", m.cpuPerExchange.Seconds()*1e6)
		}
		fmt.Fprintf(w, "%s\t%.0f\t%.0f%%\t%s\t%s\t%s\t%d\t\n", t.name, m.rate, 100*m.rate/direct,
			m.p50.Round(time.Microsecond), m.p99.Round(time.Microsecond), cpu, m.lost)
	}
	w.Flush()
}

// median takes each figure's median over the rounds separately: on a shared machine one slow
// round should move no figure.
func median(rs []result) result {
	return result{
		rate:           medianOf(rs, func(r result) float64 { return r.rate }),
		p50:            time.Duration(medianOf(rs, func(r result) float64 { return float64(r.p50) })),
		p99:            time.Duration(medianOf(rs, func(r result) float64 { return float64(r.p99) })),
		cpuPerExchange: time.Duration(medianOf(rs, func(r result) float64 { return float64(r.cpuPerExchange) })),
		lost:           int64(medianOf(rs, func(r result) float64 { return float64(r.lost) })),
	}
}

func medianOf(rs []result, f func(result) float64) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	slices.Sort(v)
	return v[len(v)/2]
}
