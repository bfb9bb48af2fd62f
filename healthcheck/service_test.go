package healthcheck

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: every health check port listens on loopback only, 127.0.0.1 (and 127.0.0.2 where
// two node addresses are needed), on ports the kernel handed out as free. --nodeport-addresses is
// 127.0.0.0/8 with a fake interface list, or empty with a listen factory that turns the wildcard
// into 127.0.0.1, so nothing listens beyond loopback.

var (
	svcA = service.NamespacedName{Namespace: "default", Name: "web"}
	svcB = service.NamespacedName{Namespace: "shop", Name: "cart"}
)

// fakeProxier is a ProxierHealth the test flips.
type fakeProxier struct{ unhealthy atomic.Bool }

func (f *fakeProxier) IsHealthy() bool { return !f.unhealthy.Load() }

// failures collects OnListenError calls.
type failures struct {
	mu   sync.Mutex
	errs []error
}

func (f *failures) report(_ service.NamespacedName, _ uint16, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs = append(f.errs, err)
}

func (f *failures) take() []error {
	f.mu.Lock()
	defer f.mu.Unlock()
	e := f.errs
	f.errs = nil
	return e
}

// recordingListen listens for real and records every address asked for.
type recordingListen struct {
	mu    sync.Mutex
	calls []string
}

func (r *recordingListen) listen(ctx context.Context, network, address string) (net.Listener, error) {
	r.mu.Lock()
	r.calls = append(r.calls, network+" "+address)
	r.mu.Unlock()
	var lc net.ListenConfig
	return lc.Listen(ctx, network, address)
}

func (r *recordingListen) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	slices.Sort(c)
	return c
}

func loopbackConfig(f *failures, p ProxierHealth) ServiceConfig {
	return ServiceConfig{
		NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		InterfaceAddrs:    func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil },
		OnListenError:     f.report,
		Proxier:           p,
	}
}

// freePorts returns n distinct TCP ports the kernel just reported free on 127.0.0.1 (held open
// together, so they differ).
func freePorts(t *testing.T, n int) []uint16 {
	t.Helper()
	var out []uint16
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		out = append(out, uint16(ln.Addr().(*net.TCPAddr).Port))
	}
	return out
}

func freePort(t *testing.T) uint16 { return freePorts(t, 1)[0] }

func url(host string, port uint16) string {
	return "http://" + netip.AddrPortFrom(netip.MustParseAddr(host), port).String() + "/"
}

// refused asserts that nothing listens on host:port.
func refused(t *testing.T, host string, port uint16) {
	t.Helper()
	c, err := net.DialTimeout("tcp", netip.AddrPortFrom(netip.MustParseAddr(host), port).String(), 5*time.Second)
	if err == nil {
		c.Close()
		t.Errorf("%s:%d accepts connections, want it closed", host, port)
	} else if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("dial %s:%d: %v, want connection refused", host, port, err)
	}
}

func serviceBody(namespace, name string, n int, healthy bool) string {
	return fmt.Sprintf("{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %t\n}",
		namespace, name, n, healthy)
}

func TestServiceHealthAnswers(t *testing.T) {
	var f failures
	px := &fakeProxier{}
	s := NewServiceHealthServer(loopbackConfig(&f, px))
	defer s.Close()
	port := freePort(t)
	s.SyncServices(map[service.NamespacedName]uint16{svcA: port})
	if errs := f.take(); len(errs) > 0 {
		t.Fatalf("SyncServices: %v", errs)
	}

	for _, step := range []struct {
		name      string
		endpoints map[service.NamespacedName]int
		unhealthy bool
		want      answer
		weight    string
	}{
		{"no_endpoint_is_503", nil, false, answer{503, serviceBody("default", "web", 0, true)}, "0"},
		{"two_local_endpoints_are_200", map[service.NamespacedName]int{svcA: 2, svcB: 7}, false, answer{200, serviceBody("default", "web", 2, true)}, "2"},
		{"stalled_proxier_is_503_despite_endpoints", map[service.NamespacedName]int{svcA: 2}, true, answer{503, serviceBody("default", "web", 2, false)}, "2"},
		{"recovered_proxier_is_200_again", map[service.NamespacedName]int{svcA: 2}, false, answer{200, serviceBody("default", "web", 2, true)}, "2"},
		{"endpoints_gone_is_503", map[service.NamespacedName]int{svcB: 1}, false, answer{503, serviceBody("default", "web", 0, true)}, "0"},
	} {
		t.Run(step.name, func(t *testing.T) {
			s.SyncEndpoints(step.endpoints)
			px.unhealthy.Store(step.unhealthy)
			c := http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
			resp, err := c.Get(url("127.0.0.1", port) + "anything")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			for k, want := range map[string]string{"Content-Type": "application/json", "X-Content-Type-Options": "nosniff",
				"X-Load-Balancing-Endpoint-Weight": step.weight} {
				if got := resp.Header.Get(k); got != want {
					t.Errorf("header %s = %q, want %q", k, got, want)
				}
			}
			if got := fetch(t, url("127.0.0.1", port)); got != step.want {
				t.Errorf("GET:\n got %d %q\nwant %d %q", got.code, got.body, step.want.code, step.want.body)
			}
		})
	}
}

func TestSyncServicesIsADiff(t *testing.T) {
	var f failures
	rec := &recordingListen{}
	cfg := loopbackConfig(&f, nil)
	cfg.Listen = rec.listen
	s := NewServiceHealthServer(cfg)
	defer s.Close()
	s.SyncEndpoints(map[service.NamespacedName]int{svcA: 1, svcB: 1})
	ports := freePorts(t, 3)
	p1, p2, p3 := ports[0], ports[1], ports[2]
	addr := func(p uint16) string { return fmt.Sprintf("tcp 127.0.0.1:%d", p) }

	for _, step := range []struct {
		name       string
		services   map[service.NamespacedName]uint16
		wantListen []string
		open       []uint16
		closed     []uint16
	}{
		{"opens_a_port_per_service", map[service.NamespacedName]uint16{svcA: p1, svcB: p2}, []string{addr(p1), addr(p2)}, []uint16{p1, p2}, []uint16{p3}},
		{"unchanged_ports_keep_their_listener", map[service.NamespacedName]uint16{svcA: p1, svcB: p2}, nil, []uint16{p1, p2}, []uint16{p3}},
		{"removed_service_closes_its_port", map[service.NamespacedName]uint16{svcA: p1}, nil, []uint16{p1}, []uint16{p2, p3}},
		{"changed_port_moves", map[service.NamespacedName]uint16{svcA: p3}, []string{addr(p3)}, []uint16{p3}, []uint16{p1, p2}},
		{"port_passed_to_another_service_in_one_sync", map[service.NamespacedName]uint16{svcB: p3}, []string{addr(p3)}, []uint16{p3}, []uint16{p1, p2}},
		{"zero_port_means_none", map[service.NamespacedName]uint16{svcB: 0}, nil, nil, []uint16{p1, p2, p3}},
	} {
		t.Run(step.name, func(t *testing.T) {
			s.SyncServices(step.services)
			if errs := f.take(); len(errs) > 0 {
				t.Fatalf("SyncServices: %v", errs)
			}
			slices.Sort(step.wantListen)
			if diff := cmp.Diff(step.wantListen, rec.take()); diff != "" {
				t.Errorf("Listen calls (-want +got):\n%s", diff)
			}
			want := map[service.NamespacedName]uint16{}
			for name, p := range step.services {
				if p != 0 {
					want[name] = p
				}
			}
			if diff := cmp.Diff(want, s.Ports()); diff != "" {
				t.Errorf("Ports() (-want +got):\n%s", diff)
			}
			for _, p := range step.open {
				if got := fetch(t, url("127.0.0.1", p)); got.code != 200 {
					t.Errorf("port %d answers %d %s, want 200", p, got.code, got.body)
				}
			}
			for _, p := range step.closed {
				refused(t, "127.0.0.1", p)
			}
		})
	}
}

func TestPortConflictIsReportedAndHealed(t *testing.T) {
	var f failures
	s := NewServiceHealthServer(loopbackConfig(&f, nil))
	defer s.Close()
	s.SyncEndpoints(map[service.NamespacedName]int{svcA: 1})

	squatter, err := net.Listen("tcp", "127.0.0.1:0") // another process holding the port
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close()
	port := uint16(squatter.Addr().(*net.TCPAddr).Port)
	want := map[service.NamespacedName]uint16{svcA: port}

	s.SyncServices(want)
	errs := f.take()
	if len(errs) != 1 || !errors.Is(errs[0], syscall.EADDRINUSE) {
		t.Fatalf("reported %v, want one error wrapping EADDRINUSE", errs)
	}
	if got, wantMsg := errs[0].Error(), fmt.Sprintf("health check for service default/web on port %d: ", port); len(got) < len(wantMsg) || got[:len(wantMsg)] != wantMsg {
		t.Errorf("error %q does not start with %q", got, wantMsg)
	}
	if len(s.Ports()) != 0 {
		t.Errorf("Ports() = %v after a failed open, want none", s.Ports())
	}

	t.Run("retried_and_reported_again_while_held", func(t *testing.T) {
		s.SyncServices(want)
		if errs := f.take(); len(errs) != 1 {
			t.Errorf("reported %v, want one error", errs)
		}
	})

	t.Run("opens_once_freed", func(t *testing.T) {
		squatter.Close()
		s.SyncServices(want)
		if errs := f.take(); len(errs) > 0 {
			t.Fatalf("reported %v after the port was freed", errs)
		}
		if got := fetch(t, url("127.0.0.1", port)); got.code != 200 {
			t.Errorf("GET answers %d %s, want 200", got.code, got.body)
		}
		if diff := cmp.Diff(want, s.Ports()); diff != "" {
			t.Errorf("Ports() (-want +got):\n%s", diff)
		}
	})
}

func TestPartialOpenIsUndone(t *testing.T) {
	var f failures
	cfg := loopbackConfig(&f, nil)
	cfg.InterfaceAddrs = func() ([]netip.Addr, error) {
		return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.0.0.2")}, nil
	}
	s := NewServiceHealthServer(cfg)
	defer s.Close()

	squatter, err := net.Listen("tcp", "127.0.0.2:0") // holds the port on the second address only
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close()
	port := uint16(squatter.Addr().(*net.TCPAddr).Port)

	s.SyncServices(map[service.NamespacedName]uint16{svcA: port})
	if errs := f.take(); len(errs) != 1 {
		t.Fatalf("reported %v, want one error", errs)
	}
	refused(t, "127.0.0.1", port) // the first address was opened, then closed again

	squatter.Close()
	s.SyncServices(map[service.NamespacedName]uint16{svcA: port})
	if errs := f.take(); len(errs) > 0 {
		t.Fatalf("reported %v after the port was freed", errs)
	}
	for _, host := range []string{"127.0.0.1", "127.0.0.2"} {
		if got := fetch(t, url(host, port)); got.code != 503 {
			t.Errorf("GET on %s answers %d %s, want 503 (no endpoints)", host, got.code, got.body)
		}
	}
}

func TestEmptyNodePortAddressesListenOnTheWildcard(t *testing.T) {
	var f failures
	var mu sync.Mutex
	var asked []string
	s := NewServiceHealthServer(ServiceConfig{
		OnListenError:  f.report,
		InterfaceAddrs: func() ([]netip.Addr, error) { return nil, errors.New("must not be called") },
		Listen: func(ctx context.Context, network, address string) (net.Listener, error) {
			mu.Lock()
			asked = append(asked, network+" "+address)
			mu.Unlock()
			var lc net.ListenConfig
			return lc.Listen(ctx, "tcp", "127.0.0.1"+address) // stay on loopback
		},
	})
	defer s.Close()
	port := freePort(t)
	s.SyncServices(map[service.NamespacedName]uint16{svcA: port})
	if errs := f.take(); len(errs) > 0 {
		t.Fatalf("SyncServices: %v", errs)
	}
	mu.Lock()
	defer mu.Unlock()
	if diff := cmp.Diff([]string{fmt.Sprintf("tcp :%d", port)}, asked); diff != "" {
		t.Errorf("Listen calls (-want +got):\n%s", diff)
	}
}

func TestNoMatchingNodeAddressIsReported(t *testing.T) {
	var f failures
	cfg := loopbackConfig(&f, nil)
	cfg.NodePortAddresses = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	s := NewServiceHealthServer(cfg)
	defer s.Close()
	s.SyncServices(map[service.NamespacedName]uint16{svcA: freePort(t)})
	if errs := f.take(); len(errs) != 1 || !errors.Is(errs[0], errNoNodeAddress) {
		t.Errorf("reported %v, want one error wrapping %v", errs, errNoNodeAddress)
	}
}

func TestRunClosesEveryPortWhenCtxEnds(t *testing.T) {
	var f failures
	s := NewServiceHealthServer(loopbackConfig(&f, nil))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()

	ports := freePorts(t, 2)
	p1, p2 := ports[0], ports[1]
	s.SyncServices(map[service.NamespacedName]uint16{svcA: p1, svcB: p2})
	if errs := f.take(); len(errs) > 0 {
		t.Fatalf("SyncServices: %v", errs)
	}
	fetch(t, url("127.0.0.1", p1))
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after ctx ended")
	}
	refused(t, "127.0.0.1", p1)
	refused(t, "127.0.0.1", p2)

	s.SyncServices(map[service.NamespacedName]uint16{svcA: p1})
	if len(s.Ports()) != 0 {
		t.Errorf("Ports() = %v after Close, want none", s.Ports())
	}
	refused(t, "127.0.0.1", p1)
}

func TestListenAddrs(t *testing.T) {
	pfx := func(ss ...string) (out []netip.Prefix) {
		for _, s := range ss {
			out = append(out, netip.MustParsePrefix(s))
		}
		return out
	}
	local := []netip.Addr{
		netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("192.168.1.7"),
		netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("::1"), netip.MustParseAddr("fd00::5"),
		netip.MustParseAddr("fe80::1"), netip.MustParseAddr("::ffff:10.1.2.3"),
	}
	for _, tc := range []struct {
		name     string
		prefixes []netip.Prefix
		want     []string
	}{
		{"empty_means_the_dual_stack_wildcard", nil, []string{"tcp :10256"}},
		{"both_zero_prefixes_mean_the_wildcard", pfx("0.0.0.0/0", "::/0"), []string{"tcp :10256"}},
		{"ipv4_zero_prefix_means_every_ipv4_address", pfx("0.0.0.0/0", "fd00::/8"), []string{"tcp4 0.0.0.0:10256", "tcp [fd00::5]:10256"}},
		{"ipv6_zero_prefix_means_every_ipv6_address", pfx("::/0", "10.0.0.0/8"), []string{"tcp6 [::]:10256", "tcp 10.0.0.5:10256", "tcp 10.1.2.3:10256"}},
		{"local_addresses_inside_the_prefixes_sorted_once", pfx("192.168.0.0/16", "10.0.0.0/8"), []string{"tcp 10.0.0.5:10256", "tcp 10.1.2.3:10256", "tcp 192.168.1.7:10256"}},
		{"loopback_when_asked", pfx("127.0.0.0/8", "::1/128"), []string{"tcp 127.0.0.1:10256", "tcp [::1]:10256"}},
		{"ipv6_link_local_skipped_as_it_needs_a_zone", pfx("fe80::/10"), nil},
		{"nothing_matches", pfx("172.16.0.0/12"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, a := range listenAddrs(tc.prefixes, local) {
				got = append(got, a.network+" "+a.address(10256))
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("listenAddrs (-want +got):\n%s", diff)
			}
		})
	}
}
