package proxier

// Address plan: cluster IPs 10.96.0.x; endpoints 10.244.1.x (the snapshot's) and 10.244.2.x (the
// sources'); proxy ports 34001-34003 are what the rules of a previous process point at. Sockets
// and portals are fakes.

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func snapPort(name service.ServicePortName, proto service.Protocol, pp uint16, eps ...string) snapshot.Port {
	sp := snapshot.Port{Name: name, Protocol: proto, ProxyPort: pp}
	for _, a := range eps {
		sp.Internal = append(sp.Internal, snapshot.Endpoint{Addr: netip.MustParseAddrPort(a), Ready: true, Serving: true})
	}
	return sp
}

func TestRestore(t *testing.T) {
	gone := service.ServicePortName{Namespace: "ns", Name: "gone", Port: "http"}
	dns := service.ServicePortName{Namespace: "ns", Name: "dns", Port: "dns"}
	unseeded := service.ServicePortName{Namespace: "ns", Name: "unseeded", Port: "http"}
	e := newFakeEnv(t, nil)
	e.p.Reopen([]Seed{
		seed("ns", "web", "http", service.TCP, 34001),
		seed("ns", "gone", "http", service.TCP, 34002),
		seed("ns", "dns", "dns", service.TCP, 34003), // the rules say TCP, the snapshot UDP
	})
	n := e.p.Restore(&snapshot.State{Node: "n", Written: e.clk.Now().Add(-time.Second), Ports: []snapshot.Port{
		func() snapshot.Port {
			sp := snapPort(webHTTP, service.TCP, 34001, "10.244.1.1:8080", "10.244.1.2:8080")
			sp.Affinity = service.Affinity{ClientIP: true, Timeout: time.Minute}
			return sp
		}(),
		snapPort(gone, service.TCP, 34002, "10.244.1.3:8080"),
		snapPort(dns, service.UDP, 34003, "10.244.1.4:53"),
		snapPort(unseeded, service.TCP, 34009, "10.244.1.5:8080"),
	}})
	e.p.paths.reopen()

	t.Run("only_reopened_ports_of_the_same_protocol_are_restored", func(t *testing.T) {
		if n != 2 {
			t.Errorf("Restore = %d; want 2 (web, gone)", n)
		}
		if got := e.balancer(dns.String()); len(got) != 0 {
			t.Errorf("dns (another protocol) got %v", got)
		}
		if e.lb.Lookup(unseeded) != nil {
			t.Errorf("a port without a reopened socket got a balancer entry")
		}
	})
	t.Run("before_the_sources_the_snapshot_serves", func(t *testing.T) {
		want := []string{"10.244.1.1:8080", "10.244.1.2:8080"}
		if diff := cmp.Diff(want, e.balancer(webHTTP.String())); diff != "" {
			t.Errorf("web (-want +got):\n%s", diff)
		}
		if ep, err := e.lb.Service(webHTTP).Next(netip.MustParseAddr("10.0.0.2"), false); err != nil || !slices.Contains(want, ep.String()) {
			t.Errorf("a pick = %v, %v; want one of the snapshot's endpoints", ep, err)
		}
	})
	t.Run("a_service_without_its_slices_yet_keeps_the_snapshot", func(t *testing.T) {
		e.p.OnServiceAdd(webService(nil))
		if got := e.balancer(webHTTP.String()); len(got) != 2 {
			t.Errorf("web after its Service (no slice yet) = %v; want the snapshot's two endpoints", got)
		}
	})
	t.Run("the_sources_endpoints_replace_the_snapshot", func(t *testing.T) {
		e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.2.1"))
		if diff := cmp.Diff([]string{"10.244.2.1:8080"}, e.balancer(webHTTP.String())); diff != "" {
			t.Errorf("web (-want +got):\n%s", diff)
		}
	})
	t.Run("a_later_empty_update_is_not_mistaken_for_not_known", func(t *testing.T) {
		e.p.OnEndpointSliceDelete(webSlice("web-1", 8080, "10.244.2.1"))
		if got := e.balancer(webHTTP.String()); len(got) != 0 {
			t.Errorf("web after its only slice went = %v; want none", got)
		}
		e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.2.1"))
	})
	t.Run("held_until_synced_a_port_the_sources_dropped_serves_from_the_snapshot", func(t *testing.T) {
		if got := e.balancer(gone.String()); len(got) != 1 {
			t.Errorf("gone before the initial lists are in = %v; want the snapshot's endpoint", got)
		}
	})
	t.Run("nothing_of_the_snapshot_survives_the_initial_lists", func(t *testing.T) {
		e.p.OnServiceAdd(makeService("ns", "empty", "10.96.0.12", func(*v1.Service) {}, tcpPort("http", 80)))
		e.synced()
		if got := e.balancer(gone.String()); len(got) != 0 {
			t.Errorf("gone after the initial lists = %v; want no endpoint", got)
		}
		if diff := cmp.Diff([]string{"10.244.2.1:8080"}, e.balancer(webHTTP.String())); diff != "" {
			t.Errorf("web (-want +got):\n%s", diff)
		}
		e.sync()
		if s := e.open[gone]; s != nil {
			t.Errorf("the reopened socket of %s is still open after the first sync", gone)
		}
	})
}

func TestRestoreWithoutSlicesDropsAtSync(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.p.Reopen([]Seed{seed("ns", "web", "http", service.TCP, 34001)})
	sp := snapPort(webHTTP, service.TCP, 34001, "10.244.1.1:8080")
	sp.Affinity = service.Affinity{ClientIP: true}
	e.p.Restore(&snapshot.State{Ports: []snapshot.Port{sp}})
	e.p.paths.reopen()
	// The Service is still there, but its endpoints went while no proxy ran.
	e.p.OnServiceAdd(webService(nil))
	e.synced()
	if got := e.balancer(webHTTP.String()); len(got) != 0 {
		t.Errorf("web = %v; want no endpoint (the snapshot's endpoint is gone from the sources)", got)
	}
	if e.lb.Service(webHTTP).Affinity().ClientIP {
		t.Errorf("web keeps the snapshot's ClientIP affinity; the Service has none")
	}
}

func TestSnapshotOfWhatIsServed(t *testing.T) {
	e := newFakeEnv(t, nil)
	gen := e.p.SnapshotGeneration()
	e.p.OnServiceAdd(webService(func(s *v1.Service) { s.Spec.SessionAffinity = v1.ServiceAffinityClientIP }))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.2.1", "10.244.2.2"))
	e.synced()
	e.sync()
	if e.p.SnapshotGeneration() == gen {
		t.Errorf("the generation did not change with the Service and its endpoints")
	}
	st := e.p.Snapshot("node-a")
	if st.Node != "node-a" || len(st.Ports) != 1 {
		t.Fatalf("Snapshot = %+v; want node-a and one port", st)
	}
	got := st.Ports[0]
	if got.Name != webHTTP || got.Protocol != service.TCP || got.ProxyPort != e.open[webHTTP].addr.Port() || !got.Affinity.ClientIP {
		t.Errorf("port = %+v; want web, TCP, proxy port %d, ClientIP affinity", got, e.open[webHTTP].addr.Port())
	}
	want := []snapshot.Endpoint{
		{Addr: netip.MustParseAddrPort("10.244.2.1:8080"), Ready: true, Serving: true},
		{Addr: netip.MustParseAddrPort("10.244.2.2:8080"), Ready: true, Serving: true},
	}
	slices.SortFunc(got.Internal, func(a, b snapshot.Endpoint) int { return a.Addr.Compare(b.Addr) })
	if diff := cmp.Diff(want, got.Internal, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
		t.Errorf("endpoints (-want +got):\n%s", diff)
	}
	// It survives its own file format.
	if _, err := snapshot.Decode(snapshot.Encode(st)); err != nil {
		t.Errorf("Decode(Encode(Snapshot)) = %v", err)
	}
}

// BenchmarkSnapshot10000Ports is one write of the daemon's snapshot writer at 10,000 service
// ports of five endpoints each: the ports taken from the proxier and streamed into the file.
func BenchmarkSnapshot10000Ports(b *testing.B) {
	e := newFakeEnv(b, nil)
	e.synced()
	var eps []sliceEP
	for i := range 5 {
		eps = append(eps, sliceEP{addr: fmt.Sprintf("10.244.0.%d", i+1)})
	}
	addServices(e, 10000, eps...)
	e.sync()
	b.ReportAllocs()
	cpu0 := procstat.CPUTime(os.Getpid())
	path := filepath.Join(b.TempDir(), "snap")
	for b.Loop() {
		if err := snapshot.WritePorts(path, "n", e.clk.Now(), e.p.SnapshotPorts()); err != nil {
			b.Fatal(err)
		}
	}
	if st, err := snapshot.Read(path, "n"); err != nil || len(st.Ports) != 10000 {
		b.Fatalf("the snapshot written: %v", err)
	}
	// CPU time is steadier than wall time on a shared machine (GC included).
	b.ReportMetric(float64(procstat.CPUTime(os.Getpid())-cpu0)/float64(b.N), "cpu-ns/op")
}

func TestRestoredUDPReadsAtOnce(t *testing.T) {
	dns := service.ServicePortName{Namespace: "ns", Name: "dns", Port: "dns"}
	other := service.ServicePortName{Namespace: "ns", Name: "other", Port: "dns"}
	e := newFakeEnv(t, nil)
	e.p.Reopen([]Seed{seed("ns", "dns", "dns", service.UDP, 34001), seed("ns", "other", "dns", service.UDP, 34002)})
	e.p.Restore(&snapshot.State{Ports: []snapshot.Port{snapPort(dns, service.UDP, 34001, "10.244.1.4:53")}})
	select {
	case <-e.p.paths.restoredGate(dns):
	default:
		t.Errorf("the gate of a restored UDP port is closed; want it to read at once")
	}
	select {
	case <-e.p.paths.restoredGate(other):
		t.Errorf("the gate of a UDP port without snapshot endpoints is open before the initial lists")
	default:
	}
}

func TestReopenRetriesAnAddressStillInUse(t *testing.T) {
	// Just after a SIGKILL the killed process's socket can outlive it for a moment.
	e := newFakeEnv(t, nil)
	e.mu.Lock()
	e.failListen[webHTTP] = fmt.Errorf("listen: %w", syscall.EADDRINUSE)
	e.mu.Unlock()
	e.p.Reopen([]Seed{seed("ns", "web", "http", service.TCP, 34001)})
	done := make(chan struct{})
	go func() { defer close(done); e.p.paths.reopen() }()
	testenv.WaitFor(t, "the reopen to wait and try again", e.clk.HasWaiters)
	e.mu.Lock()
	delete(e.failListen, webHTTP) // the old socket is gone
	e.mu.Unlock()
	e.clk.Step(20 * time.Millisecond)
	<-done
	if s := e.open[webHTTP]; s == nil || s.addr.Port() != 34001 {
		t.Errorf("web after the retry: %v; want its socket on 34001", s)
	}
}

// TestRestoredBeforeItsSocketOpens: a reopened socket accepts from the moment it listens, so its
// balancer entry has the snapshot's endpoints before it is built (the reopen fills each entry
// just before its seed's socket, on the reopen's threads); a connection in between would have
// been held until the initial lists. Each socket records what its entry held when it was built.
func TestRestoredBeforeItsSocketOpens(t *testing.T) {
	e := newFakeEnv(t, nil)
	var mu sync.Mutex
	atBuild := map[service.ServicePortName][]string{}
	build := e.p.deps.Sockets
	e.p.deps.Sockets = func(port *service.Port, picker Picker, allow func(netip.Addr) bool) ProxySocket {
		mu.Lock()
		atBuild[port.Name] = e.balancer(port.Name.String())
		mu.Unlock()
		return build(port, picker, allow)
	}
	var seeds []Seed
	var ports []snapshot.Port
	want := map[service.ServicePortName][]string{}
	for i := range 64 {
		s := seed("ns", fmt.Sprintf("s%02d", i), "http", service.TCP, uint16(34001+i))
		ep := fmt.Sprintf("10.244.1.%d:8080", i+1)
		seeds = append(seeds, s)
		ports = append(ports, snapPort(s.Name, service.TCP, s.ProxyPort, ep))
		want[s.Name] = []string{ep}
	}
	e.p.Reopen(seeds)
	if n := e.p.Restore(&snapshot.State{Ports: ports}); n != len(seeds) {
		t.Fatalf("Restore = %d, want %d", n, len(seeds))
	}
	e.p.paths.reopen()
	mu.Lock()
	defer mu.Unlock()
	if diff := cmp.Diff(want, atBuild); diff != "" {
		t.Errorf("endpoints of each entry as its socket was built (-want +got):\n%s", diff)
	}
}
