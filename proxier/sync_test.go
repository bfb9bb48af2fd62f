package proxier

// Address plan: cluster IPs 10.96.x.y, external IPs 203.0.113.x, endpoints 10.244.x.y. Sockets and
// portals are fakes: these tests check what the sync decides, not the kernel.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// fakeSocket records its life; ports are handed out from a counter like a kernel would.
type fakeSocket struct {
	env     *fakeEnv
	port    *service.Port
	addr    netip.AddrPort
	closed  chan struct{}
	once    sync.Once
	dropped []netip.AddrPort
	drained []netip.AddrPort // DrainEndpoint calls (drain_test.go)
	// allow is the source check the socket was built with; refusing, what SetRefusing last set.
	allow    func(netip.Addr) bool
	refusing bool
	// wakes counts WakeHeld calls (connpolicy_test.go), guarded by env.mu.
	wakes int
}

func (s *fakeSocket) Listen(addr netip.AddrPort) error {
	s.env.mu.Lock()
	defer s.env.mu.Unlock()
	if err := s.env.failListen[s.port.Name]; err != nil {
		return err
	}
	p := addr.Port()
	if p == 0 {
		s.env.nextPort++
		p = s.env.nextPort
	}
	s.addr = netip.AddrPortFrom(addr.Addr(), p)
	s.env.open[s.port.Name] = s
	s.env.listens = append(s.env.listens, s.addr)
	return nil
}
func (s *fakeSocket) Addr() netip.AddrPort { return s.addr }
func (s *fakeSocket) Run(ctx context.Context) error {
	select {
	case <-ctx.Done():
	case <-s.closed:
	}
	return nil
}
func (s *fakeSocket) Close() error {
	s.once.Do(func() {
		close(s.closed)
		s.env.mu.Lock()
		if s.env.open[s.port.Name] == s {
			delete(s.env.open, s.port.Name)
		}
		s.env.closedCount++
		s.env.mu.Unlock()
	})
	return nil
}
func (s *fakeSocket) SetRefusing(on bool) error {
	s.env.mu.Lock()
	defer s.env.mu.Unlock()
	s.refusing = on
	return nil
}
func (s *fakeSocket) DropEndpoint(ep netip.AddrPort) int {
	s.env.mu.Lock()
	defer s.env.mu.Unlock()
	s.dropped = append(s.dropped, ep)
	return 1
}

// recordingPortals keeps the specs of the last sync.
type recordingPortals struct {
	mu    sync.Mutex
	specs []portal.Spec
	syncs int
	err   error
}

func (r *recordingPortals) Sync(_ context.Context, specs []portal.Spec) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.syncs++
	if r.err != nil {
		return r.err
	}
	r.specs = specs
	return nil
}
func (r *recordingPortals) Cleanup(context.Context) error { return nil }

type fakeEnv struct {
	t           testing.TB
	p           *Proxier
	lb          *loadbalancer.LoadBalancer
	portals     *recordingPortals
	conntrack   *conntrack.Fake
	clk         *clocktesting.FakeClock
	mu          sync.Mutex
	open        map[service.ServicePortName]*fakeSocket
	failListen  map[service.ServicePortName]error
	nextPort    uint16
	closedCount int
	listens     []netip.AddrPort
	// built lists every socket built, in order.
	built []*fakeSocket
	// wrap, if set, is what the factory returns for each socket built (a socket with counters,
	// for the scrape's tests and benchmarks); set it before the first sync.
	wrap func(*fakeSocket) ProxySocket
}

func newFakeEnv(t testing.TB, mutate func(*Config)) *fakeEnv {
	t.Helper()
	e := &fakeEnv{t: t, portals: &recordingPortals{}, conntrack: &conntrack.Fake{},
		clk: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), open: map[service.ServicePortName]*fakeSocket{},
		failListen: map[service.ServicePortName]error{}, nextPort: 40000}
	e.lb = loadbalancer.New(e.clk)
	cfg := Config{MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second, Clock: e.clk}
	if mutate != nil {
		mutate(&cfg)
	}
	e.p = New(cfg, Deps{
		Balancer: e.lb, Portals: e.portals, Conntrack: e.conntrack,
		Sockets: func(port *service.Port, _ Picker, allow func(netip.Addr) bool) ProxySocket {
			s := &fakeSocket{env: e, port: port, closed: make(chan struct{}), allow: allow}
			e.mu.Lock()
			e.built = append(e.built, s)
			wrap := e.wrap
			e.mu.Unlock()
			if wrap != nil {
				return wrap(s)
			}
			return s
		},
	})
	ctx, cancel := context.WithCancel(context.Background())
	e.p.paths.runCtx = ctx
	t.Cleanup(func() {
		cancel()
		e.p.shutdown()
	})
	return e
}

func (e *fakeEnv) synced() {
	e.p.OnServicesSynced()
	e.p.OnEndpointSlicesSynced()
}

func (e *fakeEnv) sync() {
	e.t.Helper()
	if err := e.p.sync(context.Background()); err != nil {
		e.t.Fatalf("sync: %v", err)
	}
}

// state renders what the proxy serves: one line per open socket with its portal spec.
func (e *fakeEnv) state() string {
	e.portals.mu.Lock()
	defer e.portals.mu.Unlock()
	var lines []string
	for _, s := range e.portals.specs {
		lines = append(lines, fmt.Sprintf("%s %s/%d np=%d ips=%v ext=%v", s.Name, s.Protocol, s.Port, s.NodePort, s.ClusterIPs, s.ExternalIPs))
	}
	return strings.Join(lines, "\n")
}

func (e *fakeEnv) openNames() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for n := range e.open {
		out = append(out, n.String())
	}
	slices.Sort(out)
	return out
}

func webSlice(name string, port int32, addrs ...string) *discovery.EndpointSlice {
	var eps []sliceEP
	for _, a := range addrs {
		eps = append(eps, sliceEP{addr: a})
	}
	return makeSlice("ns", "web", name, discovery.AddressTypeIPv4, []discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, port)}, eps...)
}

func webService(mutate func(*v1.Service)) *v1.Service {
	return makeService("ns", "web", "10.96.0.10", mutate, tcpPort("http", 80))
}

var webHTTP = service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}

func TestSyncWaitsForBothSources(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.p.OnServiceAdd(webService(nil))
	e.p.OnServicesSynced()
	e.sync()
	if got := e.openNames(); len(got) != 0 || e.portals.syncs != 0 {
		t.Fatalf("before EndpointSlices synced: open=%v portal syncs=%d, want nothing", got, e.portals.syncs)
	}
	e.p.OnEndpointSlicesSynced()
	e.sync()
	if got := e.openNames(); !slices.Equal(got, []string{"ns/web:http"}) {
		t.Fatalf("open sockets = %v, want [ns/web:http]", got)
	}
}

func TestSyncLifecycle(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1", "10.244.1.2"))
	e.p.OnServiceAdd(webService(nil))
	e.sync()
	if want := "ns/web:http TCP/80 np=0 ips=[10.96.0.10] ext=[]"; e.state() != want {
		t.Fatalf("after add (-want +got):\n- %s\n+ %s", want, e.state())
	}
	if got := e.lb.Lookup(webHTTP).Endpoints(); len(got) != 2 {
		t.Fatalf("balancer endpoints = %v, want 2", got)
	}
	first := e.open[webHTTP]

	// Only affinity changes: the socket stays, the balancer learns the timeout.
	e.p.OnServiceUpdate(nil, webService(func(s *v1.Service) {
		s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr(int32(30))}}
	}))
	e.sync()
	if e.open[webHTTP] != first {
		t.Errorf("an affinity-only change reopened the socket")
	}
	if got := e.lb.Lookup(webHTTP).Affinity(); !got.ClientIP || got.Timeout != 30*time.Second {
		t.Errorf("balancer affinity = %+v, want ClientIP 30s", got)
	}

	// Port change: new socket, balancer state (endpoints) kept.
	e.p.OnServiceUpdate(nil, makeService("ns", "web", "10.96.0.10", nil, tcpPort("http", 81)))
	e.sync()
	if e.open[webHTTP] == first || e.open[webHTTP] == nil {
		t.Fatalf("a port change did not reopen the socket")
	}
	if want := "ns/web:http TCP/81 np=0 ips=[10.96.0.10] ext=[]"; e.state() != want {
		t.Errorf("after port change (-want +got):\n- %s\n+ %s", want, e.state())
	}
	if got := e.lb.Lookup(webHTTP).Endpoints(); len(got) != 2 {
		t.Errorf("balancer endpoints after port change = %v, want 2 kept", got)
	}

	// Delete: socket closed, no spec, balancer forgets the port.
	e.p.OnServiceDelete(webService(nil))
	e.sync()
	if got := e.openNames(); len(got) != 0 || e.state() != "" {
		t.Errorf("after delete: open=%v specs=%q, want nothing", got, e.state())
	}
	if e.lb.Lookup(webHTTP) != nil {
		t.Errorf("balancer still has %s after delete", webHTTP)
	}
}

func TestSyncUDPRemovalClearsConntrackEverywhere(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	dns := makeService("kube-system", "dns", "10.96.0.53", func(s *v1.Service) {
		s.Spec.ExternalIPs = []string{"203.0.113.53"}
		s.Spec.Ports[0].NodePort = 30053
	}, udpPort("dns", 53))
	e.p.OnServiceAdd(dns)
	e.sync()
	e.p.OnServiceDelete(dns)
	e.sync()
	got := e.conntrack.Dump()
	for _, want := range []string{"10.96.0.53", "203.0.113.53", "30053"} {
		if !strings.Contains(got, want) {
			t.Errorf("conntrack clears %q, want it to include %s", got, want)
		}
	}
}

func TestSyncUDPEndpointRemovalDropsSessions(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(makeService("ns", "dns", "10.96.0.53", nil, udpPort("dns", 53)))
	slice := func(addrs ...string) *discovery.EndpointSlice { return udpSlice("ns", "dns", "a", 5353, addrs...) }
	e.p.OnEndpointSliceAdd(slice("10.244.1.1", "10.244.1.2"))
	e.sync()
	e.p.OnEndpointSliceUpdate(nil, slice("10.244.1.2"))
	sock := e.open[service.ServicePortName{Namespace: "ns", Name: "dns", Port: "dns"}]
	e.mu.Lock()
	dropped := slices.Clone(sock.dropped)
	e.mu.Unlock()
	if want := []netip.AddrPort{netip.MustParseAddrPort("10.244.1.1:5353")}; !slices.Equal(dropped, want) {
		t.Errorf("dropped = %v, want %v (without waiting for a sync)", dropped, want)
	}
}

func TestSyncSocketFailureIsolated(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	bad := service.ServicePortName{Namespace: "ns", Name: "web", Port: "bad"}
	e.failListen[bad] = fmt.Errorf("listen: %w", syscall.EMFILE)
	e.p.OnServiceAdd(makeService("ns", "web", "10.96.0.10", nil, tcpPort("http", 80), tcpPort("bad", 81)))
	e.sync()
	if want := "ns/web:http TCP/80 np=0 ips=[10.96.0.10] ext=[]"; e.state() != want {
		t.Fatalf("with one failing socket (-want +got):\n- %s\n+ %s", want, e.state())
	}
	delete(e.failListen, bad)
	e.sync() // the failed port is retried on the next (periodic) sync
	if got := e.openNames(); !slices.Equal(got, []string{"ns/web:bad", "ns/web:http"}) {
		t.Errorf("after recovery open = %v", got)
	}
}

func TestSyncPortalFailureIsRetried(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.portals.err = errors.New("iptables-restore: exit status 4")
	e.p.OnServiceAdd(webService(nil))
	if err := e.p.sync(context.Background()); err == nil {
		t.Fatal("sync with failing portals returned nil")
	}
	m := e.p.deps.Metrics
	if failing, total := testutil.ToFloat64(m.SyncFailing), testutil.ToFloat64(m.SyncFailures); failing != 1 || total != 1 {
		t.Errorf("after a failed sync: sync_failing = %v, sync_failures_total = %v; want 1, 1", failing, total)
	}
	e.portals.err = nil
	e.sync()
	if e.state() == "" {
		t.Errorf("portals not programmed after the retry")
	}
	// The alert on sync_failing clears with the first good sync; the counter keeps the history.
	if failing, total := testutil.ToFloat64(m.SyncFailing), testutil.ToFloat64(m.SyncFailures); failing != 0 || total != 1 {
		t.Errorf("after the good retry: sync_failing = %v, sync_failures_total = %v; want 0, 1", failing, total)
	}
}

// TestAfterFirstSyncRunsOnceWhenPortalsAreIn checks the hook that ends the start's GC target: not
// after a failed portal sync, once after the first good one, never again.
func TestAfterFirstSyncRunsOnceWhenPortalsAreIn(t *testing.T) {
	calls := 0
	e := newFakeEnv(t, func(c *Config) { c.AfterFirstSync = func() { calls++ } })
	e.synced()
	e.portals.err = errors.New("iptables-restore: exit status 4")
	e.p.OnServiceAdd(webService(nil))
	if err := e.p.sync(context.Background()); err == nil {
		t.Fatal("sync with failing portals returned nil")
	}
	if calls != 0 {
		t.Fatalf("AfterFirstSync ran %d times after a failed sync; want 0", calls)
	}
	e.portals.err = nil
	e.sync()
	e.sync()
	if calls != 1 {
		t.Errorf("AfterFirstSync ran %d times after two good syncs; want 1", calls)
	}
}

// TestSyncPortalFailureNamesTheServicePorts checks that a failed portal sync says which service
// ports it could not apply (those changed since the last good sync) and wraps the portals' error.
func TestSyncPortalFailureNamesTheServicePorts(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(makeService("ns", "dns", "10.96.0.53", nil, tcpPort("dns-tcp", 53)))
	e.sync()

	restoreErr := errors.New("portal IPv4 nat: restore: iptables-restore: exit status 1: line 3 failed")
	e.portals.err = restoreErr
	e.p.OnServiceAdd(webService(nil))
	err := e.p.sync(context.Background())
	want := "sync portals of 2 service ports (changed since the last good sync: ns/web:http): " + restoreErr.Error()
	if err == nil || err.Error() != want || !errors.Is(err, restoreErr) {
		t.Fatalf("sync error = %v,\nwant %s (wrapping the portals' error)", err, want)
	}
	if err2 := e.p.sync(context.Background()); err2 == nil || err2.Error() != err.Error() {
		t.Errorf("the retry failed with %v, want the same error (so the runner logs it once)", err2)
	}

	e.portals.err = nil
	e.sync()
	e.portals.err = restoreErr
	if err := e.p.sync(context.Background()); err == nil || !strings.Contains(err.Error(), "changed since the last good sync: none") {
		t.Errorf("a failed periodic sync after a good one = %v, want it to say nothing changed", err)
	}

	for i := range 7 {
		e.p.paths.markUnsynced(service.ServicePortName{Namespace: "ns", Name: fmt.Sprintf("svc-%d", i), Port: "http"})
	}
	if got, want := e.p.paths.unsyncedNames(5), "ns/svc-0:http, ns/svc-1:http, ns/svc-2:http, ns/svc-3:http, ns/svc-4:http and 2 more"; got != want {
		t.Errorf("unsyncedNames(5) = %q, want %q", got, want)
	}
}

func TestSyncPortRangeExhaustion(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.PortRange = PortRange{Base: 41000, Size: 1} })
	e.synced()
	e.p.OnServiceAdd(makeService("ns", "a", "10.96.0.1", nil, tcpPort("", 80)))
	e.sync()
	var events []string
	e.p.deps.Event = func(n service.ServicePortName, reason, msg string) { events = append(events, n.String()+" "+reason) }
	e.p.OnServiceAdd(makeService("ns", "b", "10.96.0.2", nil, tcpPort("", 80)))
	e.sync()
	e.sync() // still failing: no second event
	if got := e.openNames(); !slices.Equal(got, []string{"ns/a"}) {
		t.Fatalf("open = %v, want only ns/a (range of one port)", got)
	}
	if want := []string{"ns/b ProxyPortRangeExhausted"}; !slices.Equal(events, want) {
		t.Errorf("events = %q, want %q", events, want)
	}
	e.p.OnServiceDelete(makeService("ns", "a", "10.96.0.1", nil))
	e.sync()
	if got := e.openNames(); !slices.Equal(got, []string{"ns/b"}) {
		t.Errorf("after ns/a released its port, open = %v, want [ns/b]", got)
	}
}

func TestSyncRandomOrderConverges(t *testing.T) {
	// Replaying the same final objects in different event orders, with syncs in between, must end
	// in the same sockets and specs.
	final := []*v1.Service{
		makeService("ns", "a", "10.96.0.1", nil, tcpPort("http", 80), udpPort("dns", 53)),
		makeService("ns", "b", "10.96.0.2", func(s *v1.Service) { s.Spec.ExternalIPs = []string{"203.0.113.2"} }, tcpPort("", 443)),
		makeService("ns", "c", "10.96.0.3", func(s *v1.Service) { s.Spec.Ports[0].NodePort = 30003 }, tcpPort("", 8080)),
	}
	interim := []*v1.Service{
		makeService("ns", "a", "10.96.0.1", nil, tcpPort("http", 81)),
		makeService("ns", "d", "10.96.0.4", nil, tcpPort("", 80)),
	}
	var want string
	for seed := range 20 {
		e := newFakeEnv(t, nil)
		e.synced()
		r := rand.New(rand.NewPCG(uint64(seed), 7))
		events := append(slices.Clone(interim), final...)
		r.Shuffle(len(events), func(i, j int) { events[i], events[j] = events[j], events[i] })
		for i, s := range events {
			e.p.OnServiceAdd(s)
			if i%2 == 0 {
				e.sync()
			}
		}
		for _, s := range final { // the final state of every service, then d deleted
			e.p.OnServiceUpdate(nil, s)
		}
		e.p.OnServiceDelete(interim[1])
		e.sync()
		got := e.state() + "\n" + strings.Join(e.openNames(), ",")
		if seed == 0 {
			want = got
			continue
		}
		if got != want {
			t.Fatalf("seed %d (-want +got):\n- %s\n+ %s", seed, want, got)
		}
	}
	if !strings.Contains(want, "ns/b TCP/443 np=0 ips=[10.96.0.2] ext=[203.0.113.2]") || strings.Contains(want, "ns/d") {
		t.Errorf("converged state is wrong:\n%s", want)
	}
}

func TestSync10000Services(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	addServices(e, 10000, sliceEP{addr: "10.244.0.1"}, sliceEP{addr: "10.244.0.2"})
	start := time.Now()
	e.sync()
	full := time.Since(start)
	if n := len(e.portals.specs); n != 10000 {
		t.Fatalf("specs = %d, want 10000", n)
	}
	e.p.OnServiceDelete(makeService("ns", "s42", "10.96.0.43", nil))
	start = time.Now()
	e.sync()
	one := time.Since(start)
	if n := len(e.portals.specs); n != 9999 {
		t.Fatalf("specs after one delete = %d, want 9999", n)
	}
	t.Logf("proxier sync with fake sockets and portals: 10000 ports from nothing %v, one change among 10000 %v", full, one)
}

func TestSyncListenPlan(t *testing.T) {
	// Bind mode: every portal IP at the service port and the node port on the node address.
	plan := func(p *service.Port) []netip.AddrPort {
		var out []netip.AddrPort
		for _, ip := range append(slices.Clone(p.ClusterIPs), p.ExternalIPs...) {
			out = append(out, netip.AddrPortFrom(ip, p.Port))
		}
		if p.NodePort != 0 {
			out = append(out, netip.AddrPortFrom(netip.MustParseAddr("192.0.2.1"), p.NodePort))
		}
		return out
	}
	e := newFakeEnv(t, func(c *Config) { c.ListenPlan = plan })
	e.synced()
	e.p.OnServiceAdd(makeService("ns", "web", "10.96.0.10", func(s *v1.Service) {
		s.Spec.ExternalIPs = []string{"203.0.113.10"}
		s.Spec.Ports[0].NodePort = 30080
	}, tcpPort("http", 80)))
	e.sync()
	want := "[10.96.0.10:80 203.0.113.10:80 192.0.2.1:30080]"
	if got := fmt.Sprint(e.listens); got != want {
		t.Errorf("listened on (-want +got):\n- %s\n+ %s", want, got)
	}
	e.portals.mu.Lock()
	specs := e.portals.specs
	e.portals.mu.Unlock()
	if len(specs) != 1 || specs[0].ProxyPort != 80 {
		t.Errorf("specs = %+v, want one with ProxyPort 80 (the service port)", specs)
	}
	e.p.OnServiceDelete(makeService("ns", "web", "10.96.0.10", nil))
	e.sync()
	if e.closedCount != 3 {
		t.Errorf("closed %d sockets after delete, want 3", e.closedCount)
	}
}

func TestSyncDualStackOpensOneSocketPerFamilyOnOnePort(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(makeService("ns", "dual", "10.96.0.10", func(s *v1.Service) {
		s.Spec.ClusterIPs = []string{"10.96.0.10", "fd00:96::10"}
	}, udpPort("dns", 53)))
	e.sync()
	want := "[0.0.0.0:40001 [::]:40001]"
	if got := fmt.Sprint(e.listens); got != want {
		t.Errorf("listened on (-want +got):\n- %s\n+ %s", want, got)
	}
	e.portals.mu.Lock()
	defer e.portals.mu.Unlock()
	if len(e.portals.specs) != 1 || e.portals.specs[0].ProxyPort != 40001 {
		t.Errorf("specs = %+v, want one with ProxyPort 40001", e.portals.specs)
	}
}

func TestSyncServiceAndSliceDeliveredConcurrentlyBothCount(t *testing.T) {
	// The informers deliver Services and EndpointSlices on two goroutines. Whatever the
	// interleaving, every port whose Service and slice both arrived has its endpoint at the first
	// sync: none is left refusing traffic.
	const n = 2000
	e := newFakeEnv(t, nil)
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range n {
			e.p.OnServiceAdd(makeService("ns", fmt.Sprintf("s%d", i), fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), nil, tcpPort("http", 80)))
		}
	})
	wg.Go(func() {
		for i := range n {
			e.p.OnEndpointSliceAdd(makeSlice("ns", fmt.Sprintf("s%d", i), fmt.Sprintf("s%d-1", i), discovery.AddressTypeIPv4,
				[]discovery.EndpointPort{slicePortOf("http", v1.ProtocolTCP, 8080)}, sliceEP{addr: "10.245.0.1"}))
		}
	})
	wg.Wait()
	e.synced()
	e.sync()
	e.portals.mu.Lock()
	defer e.portals.mu.Unlock()
	if len(e.portals.specs) != n {
		t.Fatalf("%d specs, want %d", len(e.portals.specs), n)
	}
	var refusing []string
	for _, s := range e.portals.specs {
		if s.RejectInternal {
			refusing = append(refusing, s.Name.String())
		}
	}
	if len(refusing) > 0 {
		t.Errorf("%d ports refuse traffic though their endpoint arrived, e.g. %v", len(refusing), refusing[:min(5, len(refusing))])
	}
}
