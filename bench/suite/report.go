package main

// report.go collects the samples, takes each figure's median over the rounds, and prints the
// table (with ratios to direct) and the JSON.

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"
)

// report is everything the suite found; it is also the JSON document.
type report struct {
	Date     string          `json:"date"`
	Machine  machine         `json:"machine"`
	Config   map[string]any  `json:"config"`
	Targets  []*targetResult `json:"targets"`
	Sync     *syncResult     `json:"rules_sync,omitempty"`
	Notes    []string        `json:"notes"`
	ElapsedS float64         `json:"elapsed_s"`

	order []string
}

// targetResult is one target's samples, their medians and the ratios of the medians to direct.
type targetResult struct {
	Name     string             `json:"name"`
	Samples  []sample           `json:"samples"`
	Median   sample             `json:"median"`
	VsDirect map[string]float64 `json:"vs_direct,omitempty"`
}

type machine struct {
	CPUs    int    `json:"nproc"`
	Kernel  string `json:"kernel"`
	CPU     string `json:"cpu_model"`
	LoadAvg string `json:"loadavg_at_start"`
}

func newReport(cfg config) *report {
	return &report{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: readMachine(),
		Config: map[string]any{
			"reps": cfg.reps, "dur": cfg.dur.String(), "warmup": cfg.warmup.String(), "bulk_mib": cfg.bulkMiB,
			"tcp_clients": cfg.conc, "udp_clients": cfg.udpClients, "udp_size": 64, "request_size": 64,
			"idle_settle": cfg.settle.String(), "sync_services": cfg.syncServices,
		},
	}
}

func readMachine() machine {
	m := machine{CPUs: runtime.NumCPU()}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPU = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		m.LoadAvg = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return m
}

func (rep *report) note(format string, args ...any) {
	rep.Notes = append(rep.Notes, fmt.Sprintf(format, args...))
}

func (rep *report) add(name string, s sample) {
	for _, t := range rep.Targets {
		if t.Name == name {
			t.Samples = append(t.Samples, s)
			return
		}
	}
	rep.Targets = append(rep.Targets, &targetResult{Name: name, Samples: []sample{s}})
}

// finish orders the targets as selected, takes the medians and the ratios to direct.
func (rep *report) finish() {
	slices.SortFunc(rep.Targets, func(a, b *targetResult) int {
		return slices.Index(rep.order, a.Name) - slices.Index(rep.order, b.Name)
	})
	var direct *targetResult
	for _, t := range rep.Targets {
		t.Median = medians(t.Samples)
		if t.Name == "direct" {
			direct = t
		}
	}
	if direct == nil {
		return
	}
	for _, t := range rep.Targets {
		t.VsDirect = map[string]float64{}
		for _, k := range []string{mBulk, mConn, mReq, mUDP, mRedisSet, mRedisSetP99, mRedisGet, mRedisGetP99, mDNSQPS, mDNSLatency} {
			if v, ok := t.Median[k]; ok && direct.Median[k] > 0 {
				t.VsDirect[k] = v / direct.Median[k]
			}
		}
	}
}

// medians takes each metric's median over the samples that have it: on a shared machine one
// slow round should move no figure.
func medians(samples []sample) sample {
	vals := map[string][]float64{}
	for _, s := range samples {
		for k, v := range s {
			vals[k] = append(vals[k], v)
		}
	}
	m := sample{}
	for k, v := range vals {
		slices.Sort(v)
		if len(v)%2 == 1 {
			m[k] = v[len(v)/2]
		} else {
			m[k] = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
	}
	return m
}

// column is one figure of the printed tables.
type column struct {
	title, key, format string
	ratio              bool // followed by its share of direct
}

var (
	rateColumns = []column{
		{"bulk Gbit/s", mBulk, "%.2f", true},
		{"conn/s", mConn, "%.0f", true},
		{"keep-alive req/s", mReq, "%.0f", true},
		{"UDP exch/s", mUDP, "%.0f", true},
	}
	costColumns = []column{
		{"CPU s/GB", mCPUPerGB, "%.2f", false},
		{"CPU µs/conn", mCPUPerConn, "%.1f", false},
		{"CPU µs/req", mCPUPerReq, "%.1f", false},
		{"CPU µs/UDP exch", mCPUPerUDP, "%.1f", false},
		{"idle conns", mIdleConns, "%.0f", false},
		{"RSS MiB", mIdleRSS, "%.1f", false},
		{"KiB/conn", mIdleKiBConn, "%.1f", false},
		{"fds", mIdleFds, "%.0f", false},
		{"fds/conn", mIdleFdsConn, "%.2f", false},
		{"half-close", mHalfClose, "%.0f", false},
	}
	// realColumns are the real clients' figures; latencies are followed by their multiple of
	// direct's (the goal: redis p99 <= 1.5x direct, rate >= 0.8x).
	realColumns = []column{
		{"redis SET/s", mRedisSet, "%.0f", true},
		{"SET p99 ms", mRedisSetP99, "%.3f", true},
		{"redis GET/s", mRedisGet, "%.0f", true},
		{"GET p99 ms", mRedisGetP99, "%.3f", true},
		{"CPU µs/redis req", mCPUPerRedis, "%.1f", false},
		{"dnsperf q/s", mDNSQPS, "%.0f", true},
		{"avg latency ms", mDNSLatency, "%.3f", true},
		{"lost %", mDNSLost, "%.2f", false},
		{"CPU µs/query", mCPUPerDNSQry, "%.1f", false},
	}
	// latencyKeys are shown as multiples of direct rather than shares.
	latencyKeys = map[string]bool{mRedisSetP99: true, mRedisGetP99: true, mDNSLatency: true}
)

func (rep *report) print(w io.Writer) {
	fmt.Fprintf(w, "\n%s, %d CPUs (%s), kernel %s, load average at start %s\n", rep.Date, rep.Machine.CPUs,
		rep.Machine.CPU, rep.Machine.Kernel, rep.Machine.LoadAvg)
	fmt.Fprintf(w, "median of %v rounds; rates with their share of direct in parentheses\n\n", rep.Config["reps"])
	rep.table(w, rateColumns)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "proxy cost (CPU: utime+stime of the proxy's process tree per operation; idle: the proxy holding the connections)")
	rep.table(w, costColumns)
	if rep.hasAny(realColumns) {
		fmt.Fprintln(w)
		fmt.Fprintln(w, "real clients (rates with their share of direct, latencies with their multiple of direct)")
		rep.table(w, realColumns)
		rep.printRedisGoal(w)
	}
	rep.printBindRatio(w)
	if rep.Sync != nil {
		fmt.Fprintln(w)
		rep.Sync.print(w)
	}
	if len(rep.Notes) > 0 {
		fmt.Fprintln(w, "\nnotes:")
		for _, n := range rep.Notes {
			fmt.Fprintf(w, "- %s\n", n)
		}
	}
	fmt.Fprintf(w, "\nwhole run: %.0f s\n", rep.ElapsedS)
}

func (rep *report) table(w io.Writer, cols []column) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight|tabwriter.Debug)
	head := []string{"target"}
	for _, c := range cols {
		head = append(head, c.title)
	}
	fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
	for _, t := range rep.Targets {
		row := []string{t.Name}
		for _, c := range cols {
			v, ok := t.Median[c.key]
			if !ok {
				row = append(row, "-")
				continue
			}
			cell := fmt.Sprintf(c.format, v)
			if r, ok := t.VsDirect[c.key]; ok && c.ratio && t.Name != "direct" {
				if latencyKeys[c.key] {
					cell += fmt.Sprintf(" (%.2f×)", r)
				} else {
					cell += fmt.Sprintf(" (%.0f%%)", 100*r)
				}
			}
			row = append(row, cell)
		}
		fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
	}
	tw.Flush()
}

// hasAny says whether some target has a figure of cols.
func (rep *report) hasAny(cols []column) bool {
	for _, t := range rep.Targets {
		for _, c := range cols {
			if _, ok := t.Median[c.key]; ok {
				return true
			}
		}
	}
	return false
}

// The redis-benchmark goal of issue 25, through each target against direct.
const (
	redisGoalRate = 0.8 // rate at least this share of direct's
	redisGoalP99  = 1.5 // p99 latency at most this multiple of direct's
)

// printRedisGoal says, for each target, whether redis-benchmark's SET and GET through it keep
// redisGoalRate of direct's rate at no more than redisGoalP99 times its p99.
func (rep *report) printRedisGoal(w io.Writer) {
	var lines []string
	for _, t := range rep.Targets {
		if t.Name == "direct" || t.VsDirect == nil {
			continue
		}
		var parts []string
		met := true
		for _, op := range []struct{ name, rate, p99 string }{{"SET", mRedisSet, mRedisSetP99}, {"GET", mRedisGet, mRedisGetP99}} {
			r, okR := t.VsDirect[op.rate]
			l, okL := t.VsDirect[op.p99]
			if !okR || !okL {
				continue
			}
			met = met && r >= redisGoalRate && l <= redisGoalP99
			parts = append(parts, fmt.Sprintf("%s rate %.2f×, p99 %.2f×", op.name, r, l))
		}
		if len(parts) == 0 {
			continue
		}
		verdict := "met"
		if !met {
			verdict = "missed"
		}
		lines = append(lines, fmt.Sprintf("  %s: %s: %s", t.Name, strings.Join(parts, "; "), verdict))
	}
	if len(lines) == 0 {
		return
	}
	fmt.Fprintf(w, "\nredis-benchmark against direct (goal: rate >= %.1f×, p99 <= %.1f×):\n%s\n",
		redisGoalRate, redisGoalP99, strings.Join(lines, "\n"))
}

// printBindRatio compares the two portal modes of the daemon (issue 8 asks for the ratio).
func (rep *report) printBindRatio(w io.Writer) {
	var ipt, bind *targetResult
	for _, t := range rep.Targets {
		switch t.Name {
		case "kpp iptables":
			ipt = t
		case "kpp bind":
			bind = t
		}
	}
	if ipt == nil || bind == nil {
		return
	}
	var parts []string
	for _, c := range append(slices.Clone(rateColumns), costColumns[:4]...) {
		a, okA := ipt.Median[c.key]
		b, okB := bind.Median[c.key]
		if okA && okB && a > 0 {
			parts = append(parts, fmt.Sprintf("%s %.2f", c.title, b/a))
		}
	}
	if len(parts) == 0 {
		return
	}
	fmt.Fprintf(w, "\nbind / iptables portal mode: %s\n", strings.Join(parts, ", "))
}

func (rep *report) writeJSON(path string) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
