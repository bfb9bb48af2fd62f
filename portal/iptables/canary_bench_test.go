package iptables

import (
	"net/netip"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// TestBenchmarkPeriodicCheck measures, at 10,000 TCP service ports on real iptables in a
// throwaway namespace, what a periodic Sync with nothing to change costs: the canary check it now
// makes every sync period, side by side (alternating, same run) with the full read-back that
// was the only way to find damage (made every VerifyPeriod, a minute). Wall time and CPU (this
// process and the iptables children) per check. Slow, so only with KPP_BENCH=1:
//
//	KPP_BENCH=1 go test -run TestBenchmarkPeriodicCheck -v -timeout 20m ./portal/iptables/
//
// KPP_BENCH_KERNEL=k puts the first k of them on the kernel path (two endpoints each, so a
// KUBE-SVC and two KUBE-SEP chains per port, all of which the canary now covers).
func TestBenchmarkPeriodicCheck(t *testing.T) {
	if os.Getenv("KPP_BENCH") == "" {
		t.Skip("set KPP_BENCH=1 to run the iptables benchmark")
	}
	const n, rounds = 10000, 5
	kernelPorts := 0
	if v := os.Getenv("KPP_BENCH_KERNEL"); v != "" {
		var err error
		if kernelPorts, err = strconv.Atoi(v); err != nil || kernelPorts > n {
			t.Fatalf("KPP_BENCH_KERNEL=%q: want a number up to %d", v, n)
		}
	}
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "bench")
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := v4Config()
	cfg.Clock, cfg.VerifyPeriod = clk, time.Minute
	cfg.KernelPath, cfg.PodCIDRs = kernelPorts > 0, []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}
	p := New(cfg, &ExecRunner{Prefix: node.CommandPrefix(), Variant: os.Getenv("KPP_BENCH_VARIANT")})
	specs := manySpecs(n, 20000)
	for i := range specs[:kernelPorts] {
		specs[i].ProxyPort = 0
		specs[i].Kernel = &portal.KernelPath{AnyEndpoints: true, Cluster: []netip.AddrPort{
			netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i / 250), byte(i%250 + 1)}), 8080),
			netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 245, byte(i / 250), byte(i%250 + 1)}), 8080)}}
	}
	slices.SortFunc(specs, portal.CompareSpecs)
	mustSync(t, p, specs)

	type cost struct{ wall, cpu time.Duration }
	measure := func(sync func()) cost {
		before := cpuTime()
		start := time.Now()
		sync()
		return cost{time.Since(start), cpuTime() - before}
	}
	var canary, full []cost
	for range rounds {
		checks := p.Stats().CanaryChecks
		canary = append(canary, measure(func() { mustSync(t, p, specs) }))
		if p.Stats().CanaryChecks == checks {
			t.Fatal("the periodic sync made no canary check")
		}
		clk.SetTime(clk.Now().Add(time.Minute)) // the read-back is due
		reads := p.Stats().ReadBacks
		full = append(full, measure(func() { mustSync(t, p, specs) }))
		if p.Stats().ReadBacks == reads {
			t.Fatal("the verify sync read nothing back")
		}
	}
	median := func(cs []cost) cost {
		w, c := make([]time.Duration, len(cs)), make([]time.Duration, len(cs))
		for i, x := range cs {
			w[i], c[i] = x.wall, x.cpu
		}
		slices.Sort(w)
		slices.Sort(c)
		return cost{w[len(w)/2], c[len(c)/2]}
	}
	var load unix.Sysinfo_t
	_ = unix.Sysinfo(&load)
	mc, mf := median(canary), median(full)
	t.Logf("%d service ports (%d on the kernel path, %d rules), median of %d alternating rounds, 1-min load %.2f:", n, kernelPorts, p.Stats().Rules, rounds, float64(load.Loads[0])/65536)
	t.Logf("  canary check (every sync period now): wall %v, CPU %v", mc.wall.Round(time.Millisecond), mc.cpu.Round(time.Millisecond))
	t.Logf("  full read-back (every VerifyPeriod):  wall %v, CPU %v", mf.wall.Round(time.Millisecond), mf.cpu.Round(time.Millisecond))
}

// cpuTime is the user and system CPU of this process and of its waited-for children.
func cpuTime() time.Duration {
	var self, children unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &self)
	_ = unix.Getrusage(unix.RUSAGE_CHILDREN, &children)
	tv := func(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }
	return tv(self.Utime) + tv(self.Stime) + tv(children.Utime) + tv(children.Stime)
}
