package proxier

import (
	"context"
	"io"
	"net/netip"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// liveHeap is the heap still reachable after a full collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// heapPeak records the most live heap seen: at every collection while it runs (read when the
// collection's finalizers run; GOGC is 2 meanwhile, so collections are frequent) and at every note.
type heapPeak struct {
	mu   sync.Mutex
	peak uint64
	stop atomic.Bool
	gogc int
}

// sentinel's finalizer runs once per collection; the pointer keeps it out of the tiny allocator.
type sentinel struct{ _ *byte }

func startHeapPeak() *heapPeak {
	h := &heapPeak{gogc: debug.SetGCPercent(2)}
	h.arm()
	return h
}

func (h *heapPeak) arm() {
	runtime.SetFinalizer(&sentinel{}, func(*sentinel) {
		s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
		metrics.Read(s)
		h.record(s[0].Value.Uint64())
		if !h.stop.Load() {
			h.arm()
		}
	})
}

func (h *heapPeak) record(v uint64) {
	h.mu.Lock()
	h.peak = max(h.peak, v)
	h.mu.Unlock()
}

func (h *heapPeak) end() uint64 {
	h.stop.Store(true)
	debug.SetGCPercent(h.gogc)
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.peak
}

// emptyTables reads back empty tables (a node's first start), notes the live heap at each
// read-back and restore (the rules, the plan and the input are alive then) and drops the restores.
type emptyTables struct{ peak *heapPeak }

func (r emptyTables) Restore(_ context.Context, _ portal.Family, data []byte) error {
	r.peak.record(liveHeap())
	runtime.KeepAlive(data) // iptables-restore reads it until it exits
	return nil
}

// RestoreFrom reads the input as iptables-restore does (ExecRunner streams it), noting the heap
// once the command has its first chunk.
func (r emptyTables) RestoreFrom(_ context.Context, _ portal.Family, input io.Reader) error {
	first := make([]byte, 32<<10)
	_, err := io.ReadFull(input, first)
	r.peak.record(liveHeap())
	if err == io.ErrUnexpectedEOF || err == io.EOF {
		return nil
	}
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, input)
	return err
}

func (r emptyTables) Save(_ context.Context, _ portal.Family, table string) ([]byte, error) {
	r.peak.record(liveHeap())
	return []byte("*" + table + "\nCOMMIT\n"), nil
}

func (emptyTables) Command(context.Context, portal.Family, ...string) error { return nil }
func (emptyTables) Chains(context.Context, portal.Family) (iptables.Chains, error) {
	return nil, iptables.ErrUnavailable
}

// BenchmarkFirstSyncHeap is the first sync of the file-mode scale bench's load, 10,000 service
// ports with 5 endpoints each, through the real iptables portals (as the daemon configures them)
// and fake sockets. MB-temp is the live heap at the sync's peak beyond what stays after it: what
// the first sync adds to the process's peak.
func BenchmarkFirstSyncHeap(b *testing.B) {
	eps := []sliceEP{{addr: "10.244.0.1"}, {addr: "10.244.0.2"}, {addr: "10.244.0.3"}, {addr: "10.244.0.4"}, {addr: "10.244.0.5"}}
	var before, peak, after float64
	for b.Loop() {
		b.StopTimer()
		e := newFakeEnv(b, nil)
		e.synced()
		addServices(e, 10000, eps...)
		b0 := liveHeap()
		h := startHeapPeak()
		e.p.deps.Portals = iptables.New(iptables.Config{
			HostIPs:           map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("192.168.1.10")},
			ProtectProxyPorts: true, KernelPath: true, NoRandomFully: true,
		}, emptyTables{peak: h})
		b.StartTimer()
		e.sync()
		b.StopTimer()
		pk := h.end()
		a := liveHeap()
		before, peak, after = before+float64(b0), peak+float64(pk), after+float64(a)
		e.p.shutdown()
		b.StartTimer()
	}
	n := float64(b.N) * 1e6
	b.ReportMetric(before/n, "MB-live-before")
	b.ReportMetric(peak/n, "MB-live-peak")
	b.ReportMetric(after/n, "MB-live-after")
	b.ReportMetric((peak-after)/n, "MB-temp")
}
