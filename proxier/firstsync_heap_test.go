package proxier

import (
	"context"
	"io"
	"net/netip"
	"runtime"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// emptyTables reads back empty tables (a node's first start), notes the live heap at each
// read-back and restore (the rules, the plan and the input are alive then) and drops the restores.
type emptyTables struct{ peak *testenv.HeapPeak }

func (r emptyTables) Restore(_ context.Context, _ portal.Family, data []byte) error {
	r.peak.Note()
	runtime.KeepAlive(data) // iptables-restore reads it until it exits
	return nil
}

// RestoreFrom reads the input as iptables-restore does (ExecRunner streams it), noting the heap
// once the command has its first chunk.
func (r emptyTables) RestoreFrom(_ context.Context, _ portal.Family, input io.Reader) error {
	return r.peak.ReadNoting(input)
}

func (r emptyTables) Save(_ context.Context, _ portal.Family, table string) ([]byte, error) {
	r.peak.Note()
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
		b0 := testenv.LiveHeap()
		h := testenv.StartHeapPeak()
		e.p.deps.Portals = iptables.New(iptables.Config{
			HostIPs:           map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("192.168.1.10")},
			ProtectProxyPorts: true, KernelPath: true, NoRandomFully: true,
		}, emptyTables{peak: h})
		b.StartTimer()
		e.sync()
		b.StopTimer()
		pk := h.End()
		a := testenv.LiveHeap()
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
