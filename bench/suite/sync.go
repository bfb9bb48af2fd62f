package main

// sync.go measures the rules sync of the real daemon at scale by running bench/scale (cold start
// to every portal programmed, RSS, idle CPU, programming latency of one change) and parsing what
// it prints.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// syncResult is what bench/scale reported.
type syncResult struct {
	Services      int       `json:"service_ports"`
	ColdStartS    float64   `json:"cold_start_s"`
	RSSMiB        float64   `json:"rss_mib"`
	IdleCPUPct    float64   `json:"idle_cpu_pct_of_core"`
	LatencyS      []float64 `json:"programming_latency_s"`
	LatencyMedian float64   `json:"programming_latency_median_s"`
	Output        []string  `json:"output"`
}

// runScale builds bench/scale and runs it against the daemon binary.
func runScale(ctx context.Context, cfg config) (*syncResult, error) {
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "kpp-suite-scale-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "scale")
	build := exec.CommandContext(ctx, cfg.goTool, "build", "-o", bin, "./bench/scale")
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build bench/scale (run from the repository root): %w: %s", err, out)
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "-proxy", cfg.proxy, "-services", strconv.Itoa(cfg.syncServices),
		"-endpoints", "5", "-idle", cfg.syncIdle.String(), "-changes", strconv.Itoa(cfg.syncChanges))
	cmd.Stdout = io.MultiWriter(&out, os.Stdout)
	cmd.Stderr = os.Stderr
	// SIGTERM on timeout lets bench/scale delete its namespaces.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 30 * time.Second
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("bench/scale: %w", err)
	}
	return parseScale(out.String(), cfg.syncServices)
}

var (
	reCold    = regexp.MustCompile(`cold start to all portals programmed: (\S+)`)
	reRSS     = regexp.MustCompile(`RSS with everything loaded: ([\d.]+) MiB`)
	reIdle    = regexp.MustCompile(`idle CPU over \S+: ([\d.]+)% of one core`)
	reLatency = regexp.MustCompile(`programming latency .*samples: \[(.*)\]`)
)

// parseScale reads bench/scale's report lines.
func parseScale(out string, n int) (*syncResult, error) {
	r := &syncResult{Services: n}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		r.Output = append(r.Output, strings.TrimSpace(l))
	}
	if m := reCold.FindStringSubmatch(out); m != nil {
		d, err := time.ParseDuration(m[1])
		if err != nil {
			return r, fmt.Errorf("cold start %q: %w", m[1], err)
		}
		r.ColdStartS = d.Seconds()
	} else {
		return r, fmt.Errorf("bench/scale printed no cold start: %q", out)
	}
	if m := reRSS.FindStringSubmatch(out); m != nil {
		r.RSSMiB, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reIdle.FindStringSubmatch(out); m != nil {
		r.IdleCPUPct, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := reLatency.FindStringSubmatch(out); m != nil {
		for _, f := range strings.Fields(m[1]) {
			d, err := time.ParseDuration(f)
			if err != nil {
				return r, fmt.Errorf("latency %q: %w", f, err)
			}
			r.LatencyS = append(r.LatencyS, d.Seconds())
		}
	}
	if len(r.LatencyS) > 0 {
		s := slices.Sorted(slices.Values(r.LatencyS))
		r.LatencyMedian = s[len(s)/2]
	}
	return r, nil
}

func (r *syncResult) print(w io.Writer) {
	fmt.Fprintf(w, "rules sync, the daemon at %d service ports (iptables portals, bench/scale): cold start to all programmed %.2f s, "+
		"RSS %.1f MiB, idle CPU %.2f%% of a core, programming latency of one change median %.0f ms (%d samples)\n",
		r.Services, r.ColdStartS, r.RSSMiB, r.IdleCPUPct, r.LatencyMedian*1000, len(r.LatencyS))
}
