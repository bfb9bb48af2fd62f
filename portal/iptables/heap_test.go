package iptables

import (
	"context"
	"io"
	"runtime"
	"slices"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// peakRunner is nullRunner that notes the live heap at each read-back and restore, where the
// rules, the plan and the restore input are alive.
type peakRunner struct {
	nullRunner
	peak *testenv.HeapPeak
}

func (r peakRunner) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	r.peak.Note()
	runtime.KeepAlive(data) // iptables-restore reads it until it exits
	return nil
}

// RestoreFrom reads the input as iptables-restore does, noting the heap once the command has
// its first chunk.
func (r peakRunner) RestoreFrom(ctx context.Context, fam portal.Family, input io.Reader) error {
	return r.peak.ReadNoting(input)
}

func (r peakRunner) Save(ctx context.Context, fam portal.Family, table string) ([]byte, error) {
	r.peak.Note()
	return r.nullRunner.Save(ctx, fam, table)
}

// BenchmarkFirstSyncHeap is the first sync of 10,000 proxy-path service ports (the file-mode
// scale bench's: cluster IP, guarded proxy port, kernel path chains as the daemon runs them) on a
// node with no rules yet. MB-temp is what the sync holds at its peak beyond what stays after
// it (the rules in force, the specs): the part of the process's peak the sync adds.
func BenchmarkFirstSyncHeap(b *testing.B) {
	cfg := v4Config()
	cfg.ProtectProxyPorts, cfg.KernelPath, cfg.NoRandomFully = true, true, true
	specs := manySpecs(10000, 20000)
	var before, peak, after float64
	for b.Loop() {
		b.StopTimer()
		h := &testenv.HeapPeak{}
		p := New(cfg, peakRunner{peak: h})
		b0 := testenv.LiveHeap()
		h = testenv.StartHeapPeak()
		p.runner = peakRunner{peak: h}
		b.StartTimer()
		if err := p.Sync(b.Context(), specs); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		pk := h.End()
		a := testenv.LiveHeap()
		runtime.KeepAlive(p)
		before, peak, after = before+float64(b0), peak+float64(pk), after+float64(a)
		b.StartTimer()
	}
	n := float64(b.N) * 1e6
	b.ReportMetric(before/n, "MB-live-before")
	b.ReportMetric(peak/n, "MB-live-peak")
	b.ReportMetric(after/n, "MB-live-after")
	b.ReportMetric((peak-after)/n, "MB-temp")
}

// TestFirstSyncHoldsLittleBeyondWhatStays: the first sync of 10,000 service ports, with a runner
// that reads the restore input as the command consumes it (as ExecRunner does), holds at its
// peak at most 3 MB more than stays after it (the rules in force, the specs): 0.0 MB here, 1.9 MB
// in a -race build, whose instrumented code keeps more on the heap. It held 11.8 MB
// more: a string per input line, a growing buffer's outgrown halves, the filter table's input
// while nat's was built, the whole input of each restore (nat's is 2.9 MB) and a copy of the specs.
func TestFirstSyncHoldsLittleBeyondWhatStays(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts, cfg.KernelPath, cfg.NoRandomFully = true, true, true
	specs := manySpecs(10000, 20000)
	slices.SortFunc(specs, portal.CompareSpecs) // as the proxier passes them
	p := New(cfg, nullRunner{})
	h := testenv.StartHeapPeak()
	p.runner = peakRunner{peak: h}
	err := p.Sync(t.Context(), specs)
	peak := h.End()
	if err != nil {
		t.Fatal(err)
	}
	after := testenv.LiveHeap()
	runtime.KeepAlive(p)
	const limit = 3 << 20
	if extra := int64(peak) - int64(after); extra > limit {
		t.Errorf("the first sync's peak live heap is %.1f MB above what stays after it, want at most %.1f MB",
			float64(extra)/1e6, float64(limit)/1e6)
	}
}
