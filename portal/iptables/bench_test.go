package iptables

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// TestBenchmarkPortalSync measures programming real iptables in a throwaway namespace, against
// the legacy method (one `iptables -C` plus one `iptables -A` per rule, as EnsureRule did). It
// is slow and noisy, so it runs only with KPP_BENCH=1:
//
//	KPP_BENCH=1 go test -run TestBenchmarkPortalSync -v -timeout 30m ./portal/iptables/
//
// KPP_BENCH_VARIANT=legacy (or nft) picks iptables-legacy* / iptables-nft* binaries.
func TestBenchmarkPortalSync(t *testing.T) {
	if os.Getenv("KPP_BENCH") == "" {
		t.Skip("set KPP_BENCH=1 to run the iptables benchmark")
	}
	variant := os.Getenv("KPP_BENCH_VARIANT")
	for _, n := range []int{1000, 10000} {
		legacySample := 100
		if n > 1000 {
			legacySample = 20 // each legacy command costs most of a second at this size
		}
		lab := netns.NewTestLab(t)
		node := lab.MustAdd(t, "bench")
		runner := &ExecRunner{Prefix: node.CommandPrefix(), Variant: variant}
		cfg := v4Config()
		// KPP_BENCH_KERNEL_PATH=1: as the daemon runs iptables mode, with the kernel data path's
		// top-level chains beside the (proxy-path) portals.
		cfg.KernelPath = os.Getenv("KPP_BENCH_KERNEL_PATH") == "1"
		p := New(cfg, runner)
		specs := manySpecs(n, 20000)
		slices.SortFunc(specs, portal.CompareSpecs) // as the proxier passes them
		rules := 2 * n

		start := time.Now()
		mustSync(t, p, specs)
		full := time.Since(start)

		// A changed proxy port: "effective" is when the new rules are in (the first restore of the
		// nat table: the hook sees it return), "change" the whole sync with the stale rules deleted.
		specs[n/2].ProxyPort = 65000
		timed := &firstRestoreTimer{Runner: runner}
		p.runner = timed
		start = time.Now()
		timed.start = start
		mustSync(t, p, specs)
		change := time.Since(start)
		effective := timed.natApplied
		p.runner = runner

		add := append(specs, manySpecs(n+1, 20000)[n])
		start = time.Now()
		mustSync(t, p, add)
		added := time.Since(start)

		start = time.Now()
		mustSync(t, p, add)
		noop := time.Since(start)

		// Legacy: EnsureRule = -C (fails) then -A, per rule, into chains already holding n ports.
		extra := manySpecs(n+1+legacySample, 20000)[n+1:]
		fake := NewFake()
		mustSync(t, New(v4Config(), fake), extra)
		var legacyRules [][]string
		for _, l := range strings.Split(fake.Dump(), "\n") {
			// The canary chain and the jumps to it are one per table, already in place: not
			// per-port rules the legacy method would add.
			if strings.HasPrefix(l, "-A KUBE-PORTALS-") && !strings.Contains(l, ChainCanary) {
				legacyRules = append(legacyRules, splitRule(strings.TrimPrefix(l, "-A ")))
			}
		}
		start = time.Now()
		for _, r := range legacyRules {
			if err := runner.Command(t.Context(), portal.IPv4, append([]string{"-t", "nat", "-C"}, r...)...); err == nil {
				t.Fatalf("legacy -C found a rule that should not exist: %v", r)
			}
			if err := runner.Command(t.Context(), portal.IPv4, append([]string{"-t", "nat", "-A"}, r...)...); err != nil {
				t.Fatal(err)
			}
		}
		perRule := time.Since(start) / time.Duration(len(legacyRules))
		start = time.Now()
		for _, r := range legacyRules {
			if err := runner.Command(t.Context(), portal.IPv4, append([]string{"-t", "nat", "-C"}, r...)...); err != nil {
				t.Fatal(err)
			}
		}
		perCheck := time.Since(start) / time.Duration(len(legacyRules))

		t.Logf("%d service ports (%d nat rules), iptables variant %q, kernel path chains %v:", n, rules, variant, cfg.KernelPath)
		t.Logf("  restore: full sync from nothing %v, one proxy port changed %v (new rules in force after %v), one port added %v, no change %v",
			full.Round(time.Millisecond), change.Round(time.Millisecond), effective.Round(time.Millisecond),
			added.Round(time.Millisecond), noop.Round(time.Microsecond))
		t.Logf("  legacy (sample of %d rules at this size): %v per rule (-C + -A) => full sync ~%v; no-change sync (-C per rule) ~%v",
			len(legacyRules), perRule.Round(time.Microsecond), (perRule * time.Duration(rules)).Round(time.Second),
			(perCheck * time.Duration(rules)).Round(time.Second))
		if err := lab.Close(); err != nil {
			t.Error(err)
		}
	}
}

// firstRestoreTimer notes when the first nat restore of a sync has returned.
type firstRestoreTimer struct {
	Runner
	start      time.Time
	natApplied time.Duration
}

func (r *firstRestoreTimer) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	err := r.Runner.Restore(ctx, fam, data)
	if r.natApplied == 0 && strings.HasPrefix(string(data), "*nat") {
		r.natApplied = time.Since(r.start)
	}
	return err
}
