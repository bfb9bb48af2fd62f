package main

// realclients.go measures what users run rather than our own load generators: redis-benchmark
// against a real redis-server, and dnsperf against a real DNS server (unbound answering a static
// local zone), both in the pod namespace, reached through each target (cluster IP, node address,
// or directly). The clients run in the client namespace; their own reports give the rates and
// latencies, the harness reads the proxy's CPU time around each run.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// The real servers' ports in the pod, their cluster IPs and the node ports HAProxy and nginx use.
const (
	redisPort = 6379
	dnsPort   = 5300
)

var (
	redisVIP  = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.12"), 6379)
	realDNSIP = netip.AddrPortFrom(netip.MustParseAddr("10.96.0.54"), 53)
	nodeRedis = netip.AddrPortFrom(testbed.NodeClientIP, 16379)
	nodeDNS   = netip.AddrPortFrom(testbed.NodeClientIP, 10054)
)

// The metric keys of the real clients.
const (
	mRedisSet     = "redis_set_s"
	mRedisSetP99  = "redis_set_p99_ms"
	mRedisGet     = "redis_get_s"
	mRedisGetP99  = "redis_get_p99_ms"
	mCPUPerRedis  = "cpu_us_per_redis_req"
	mDNSQPS       = "dnsperf_qps"
	mDNSLatency   = "dnsperf_avg_latency_ms"
	mDNSLost      = "dnsperf_lost_pct"
	mCPUPerDNSQry = "cpu_us_per_dns_query"
)

// realClientsSkip says why the real-client tests cannot run here ("" when they can).
func realClientsSkip() string {
	for _, bin := range []string{"redis-server", "redis-benchmark", "unbound", "dnsperf"} {
		if s := available(bin); s != "" {
			return s + " (apt-get install redis-server redis-tools unbound dnsperf)"
		}
	}
	return ""
}

// startRealServers runs redis-server and unbound in the pod and waits until both answer.
func (b *bed) startRealServers(ctx context.Context) error {
	pod := b.tb.Pods[0].NS
	redis, err := startChild(ctx, pod, "redis-server", nil, "redis-server",
		"--bind", testbed.PodIP(1).String(), "--port", strconv.Itoa(redisPort), "--save", "", "--appendonly", "no",
		"--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning", "--dir", b.dir)
	if err != nil {
		return err
	}
	b.servers = append(b.servers, redis)
	conf := filepath.Join(b.dir, "unbound.conf")
	if err := os.WriteFile(conf, []byte(unboundConf(testbed.PodIP(1))), 0o644); err != nil {
		return err
	}
	unbound, err := startChild(ctx, pod, "unbound", nil, "unbound", "-d", "-c", conf)
	if err != nil {
		return err
	}
	b.servers = append(b.servers, unbound)
	if err := testbed.Eventually(ctx, 10*time.Second, 50*time.Millisecond, func() error {
		return redisPing(pod, podAddr(redisPort))
	}); err != nil {
		return fmt.Errorf("redis-server: %w", err)
	}
	return testbed.Eventually(ctx, 10*time.Second, 50*time.Millisecond, func() error {
		return dnsQuery(pod, podAddr(dnsPort))
	})
}

// unboundConf is a single-threaded authoritative-only unbound: one static local zone, no
// recursion, nothing fetched, logs to stderr.
func unboundConf(ip netip.Addr) string {
	return fmt.Sprintf(`server:
  interface: %s@%d
  do-daemonize: no
  chroot: ""
  username: ""
  pidfile: ""
  directory: ""
  use-syslog: no
  logfile: ""
  verbosity: 0
  num-threads: 1
  do-ip6: no
  do-tcp: no
  access-control: 0.0.0.0/0 allow
  local-zone: "bench." static
  local-data: "www.bench. 300 IN A 192.0.2.80"
remote-control:
  control-enable: no
`, ip, dnsPort)
}

// dnsperfQueries is dnsperf's input: one name of the zone, asked over and over.
const dnsperfQueries = "www.bench. A\n"

// redisPing sends PING to addr from ns and expects PONG.
func redisPing(ns *netns.NS, addr netip.AddrPort) error {
	c, err := testbed.Dial(ns, addr, 300*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "+PONG\r\n" {
		return fmt.Errorf("PING: %q", line)
	}
	return nil
}

// dnsQuery asks addr for www.bench. A from ns and expects an answer with the same ID.
func dnsQuery(ns *netns.NS, addr netip.AddrPort) error {
	var c net.Conn
	if err := ns.Do(func() (err error) { c, err = net.Dial("udp4", addr.String()); return err }); err != nil {
		return err
	}
	defer c.Close()
	// ID 0x4b50, RD, one question: www.bench. IN A.
	q := []byte{0x4b, 0x50, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0,
		3, 'w', 'w', 'w', 5, 'b', 'e', 'n', 'c', 'h', 0, 0, 1, 0, 1}
	_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Write(q); err != nil {
		return err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if n < 12 || buf[0] != 0x4b || buf[1] != 0x50 || buf[3]&0x0f != 0 {
		return fmt.Errorf("DNS answer % x", buf[:min(n, 12)])
	}
	return nil
}

// measureReal runs redis-benchmark and dnsperf through the target, when it serves them.
func measureReal(ctx context.Context, cfg config, b *bed, r *running, s sample) error {
	if r.redis.IsValid() {
		if err := measureRedis(ctx, cfg, b, r, s); err != nil {
			return fmt.Errorf("redis-benchmark: %w", err)
		}
	}
	if r.dns.IsValid() {
		if err := measureDNS(ctx, cfg, b, r, s); err != nil {
			return fmt.Errorf("dnsperf: %w", err)
		}
	}
	return nil
}

// measureRedis runs redis-benchmark SET and GET with cfg.conc clients, one request in flight each.
func measureRedis(ctx context.Context, cfg config, b *bed, r *running, s sample) error {
	if err := testbed.Eventually(ctx, 10*time.Second, 50*time.Millisecond, func() error {
		return redisPing(b.tb.Client, r.redis)
	}); err != nil {
		return err
	}
	var out []byte
	cpu, err := proxyCPU(r.pid, func() (err error) {
		out, err = runIn(ctx, b.tb.Client, 2*time.Minute, "redis-benchmark", "-h", r.redis.Addr().String(),
			"-p", strconv.Itoa(int(r.redis.Port())), "-c", strconv.Itoa(cfg.conc), "-n", strconv.Itoa(cfg.redisReqs),
			"-t", "set,get", "--csv")
		return err
	})
	if err != nil {
		return err
	}
	res, err := parseRedisCSV(out)
	if err != nil {
		return err
	}
	set, okSet := res["SET"]
	get, okGet := res["GET"]
	if !okSet || !okGet {
		return fmt.Errorf("no SET and GET rows in %q", out)
	}
	s[mRedisSet], s[mRedisSetP99] = set.rps, set.p99ms
	s[mRedisGet], s[mRedisGetP99] = get.rps, get.p99ms
	if r.pid != 0 {
		s[mCPUPerRedis] = cpu.Seconds() / float64(2*cfg.redisReqs) * 1e6
	}
	return nil
}

// redisRow is one test of redis-benchmark --csv.
type redisRow struct{ rps, p99ms float64 }

// parseRedisCSV reads redis-benchmark --csv (7.x): a header naming the columns, then one row per
// test ("SET", "GET").
func parseRedisCSV(out []byte) (map[string]redisRow, error) {
	recs, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	if err != nil {
		return nil, fmt.Errorf("csv: %w", err)
	}
	if len(recs) < 2 {
		return nil, fmt.Errorf("csv: no rows in %q", out)
	}
	col := map[string]int{}
	for i, h := range recs[0] {
		col[h] = i
	}
	iTest, ok0 := col["test"]
	iRPS, ok1 := col["rps"]
	iP99, ok2 := col["p99_latency_ms"]
	if !ok0 || !ok1 || !ok2 {
		return nil, fmt.Errorf("csv: header %q lacks test, rps or p99_latency_ms", recs[0])
	}
	rows := map[string]redisRow{}
	for _, rec := range recs[1:] {
		if len(rec) <= max(iTest, iRPS, iP99) {
			continue
		}
		rps, err1 := strconv.ParseFloat(rec[iRPS], 64)
		p99, err2 := strconv.ParseFloat(rec[iP99], 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("csv: row %q: bad number", rec)
		}
		rows[rec[iTest]] = redisRow{rps: rps, p99ms: p99}
	}
	return rows, nil
}

// measureDNS runs dnsperf for cfg.dur with cfg.udpClients sockets.
func measureDNS(ctx context.Context, cfg config, b *bed, r *running, s sample) error {
	if err := testbed.Eventually(ctx, 10*time.Second, 50*time.Millisecond, func() error {
		return dnsQuery(b.tb.Client, r.dns)
	}); err != nil {
		return err
	}
	queries := filepath.Join(b.dir, "dnsperf.txt")
	if err := os.WriteFile(queries, []byte(dnsperfQueries), 0o644); err != nil {
		return err
	}
	secs := max(1, int(cfg.dur.Round(time.Second)/time.Second))
	var out []byte
	cpu, err := proxyCPU(r.pid, func() (err error) {
		out, err = runIn(ctx, b.tb.Client, time.Duration(secs)*time.Second+time.Minute, "dnsperf",
			"-s", r.dns.Addr().String(), "-p", strconv.Itoa(int(r.dns.Port())), "-d", queries,
			"-l", strconv.Itoa(secs), "-c", strconv.Itoa(cfg.udpClients), "-T", "2", "-q", "64", "-t", "2")
		return err
	})
	if err != nil {
		return err
	}
	res, err := parseDNSPerf(out)
	if err != nil {
		return err
	}
	s[mDNSQPS], s[mDNSLatency], s[mDNSLost] = res.qps, res.avgLatencyMS, res.lostPct
	if r.pid != 0 && res.completed > 0 {
		s[mCPUPerDNSQry] = cpu.Seconds() / res.completed * 1e6
	}
	return nil
}

// dnsperfResult is what the suite keeps of dnsperf's statistics.
type dnsperfResult struct {
	qps, avgLatencyMS, lostPct, completed float64
}

// parseDNSPerf reads dnsperf's (2.x) closing statistics.
func parseDNSPerf(out []byte) (dnsperfResult, error) {
	var res dnsperfResult
	found := 0
	for _, line := range strings.Split(string(out), "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		num, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		switch k {
		case "Queries per second":
			res.qps = num
			found++
		case "Average Latency (s)":
			res.avgLatencyMS = num * 1e3
			found++
		case "Queries completed":
			res.completed = num
			found++
		case "Queries lost":
			if len(f) > 1 {
				res.lostPct, _ = strconv.ParseFloat(strings.Trim(f[1], "(%)"), 64)
			}
			found++
		}
	}
	if found < 4 {
		return res, fmt.Errorf("no statistics in %q", lastLines(string(out), 15))
	}
	return res, nil
}

// toolVersion is the first line argv prints, for the notes.
func toolVersion(argv ...string) string {
	out, _ := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	return lastLines(strings.SplitN(string(out), "\n", 2)[0], 1)
}

// proxyCPU runs f and returns the CPU time the proxy (pid; 0: none) used meanwhile.
func proxyCPU(pid int, f func() error) (time.Duration, error) {
	if pid == 0 {
		return 0, f()
	}
	cpu0 := procstat.CPUTime(pid)
	err := f()
	return procstat.CPUTime(pid) - cpu0, err
}

// runIn runs argv in ns, bounded by timeout, and returns its stdout.
func runIn(ctx context.Context, ns *netns.NS, timeout time.Duration, argv ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	args := append(ns.CommandPrefix(), argv...)
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s: %w: %s", argv[0], err, lastLines(stderr.String(), 5))
	}
	return out, nil
}
