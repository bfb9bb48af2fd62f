package proxier

// Address plan: cluster IPs 10.96.0.x, endpoints 10.244.1.x; proxy ports 34001-34003 are what the
// rules of a previous process point at. Sockets and portals are fakes.

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func seed(ns, name, port string, proto service.Protocol, pp uint16) Seed {
	return Seed{Name: service.ServicePortName{Namespace: ns, Name: name, Port: port}, Protocol: proto, ProxyPort: pp,
		Families: []portal.Family{portal.IPv4}}
}

func TestReopen(t *testing.T) {
	logged := service.ServicePortName{Namespace: "ns", Name: "logged", Port: "http"}
	gone := service.ServicePortName{Namespace: "ns", Name: "gone", Port: ""}
	e := newFakeEnv(t, nil)
	e.p.Reopen([]Seed{
		seed("ns", "web", "http", service.TCP, 34001),
		seed("ns", "gone", "", service.UDP, 34002),
		seed("ns", "logged", "http", service.TCP, 34003),
	})
	e.p.paths.reopen()

	// Before any Service is known, each port the rules point at is listened on again.
	for name, pp := range map[service.ServicePortName]uint16{webHTTP: 34001, gone: 34002, logged: 34003} {
		s := e.open[name]
		if s == nil || s.addr != netip.AddrPortFrom(netip.IPv4Unspecified(), pp) {
			t.Fatalf("%s: reopened socket %v, want one on 0.0.0.0:%d", name, s, pp)
		}
	}
	reopened, reopenedLogged := e.open[webHTTP], e.open[logged]

	e.p.OnServiceAdd(webService(nil))
	e.p.OnServiceAdd(makeService("ns", "logged", "10.96.0.11", func(s *v1.Service) {
		s.Annotations = map[string]string{AnnotationAccessLog: "true"}
	}, tcpPort("http", 80)))
	e.synced()
	e.sync()

	t.Run("the_first_sync_adopts_a_reopened_socket", func(t *testing.T) {
		if e.open[webHTTP] != reopened {
			t.Errorf("web's socket was replaced; want the reopened one kept")
		}
	})
	t.Run("rules_keep_their_proxy_ports", func(t *testing.T) {
		got := map[service.ServicePortName]uint16{}
		for _, s := range e.portals.specs {
			got[s.Name] = s.ProxyPort
		}
		want := map[service.ServicePortName]uint16{webHTTP: 34001, logged: 34003}
		if len(got) != len(want) || got[webHTTP] != 34001 || got[logged] != 34003 {
			t.Errorf("spec proxy ports = %v, want %v", got, want)
		}
	})
	t.Run("a_socket_needing_other_options_is_opened_again_on_its_port", func(t *testing.T) {
		if s := e.open[logged]; s == reopenedLogged || s == nil || s.addr.Port() != 34003 {
			t.Errorf("logged socket = %v; want a new socket on port 34003", s)
		}
	})
	t.Run("a_gone_service_port_is_closed", func(t *testing.T) {
		if s := e.open[gone]; s != nil {
			t.Errorf("socket of %s still open after the first sync", gone)
		}
	})
}

func TestReopenCounts(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.failListen[service.ServicePortName{Namespace: "ns", Name: "taken", Port: "http"}] = errors.New("address in use")
	e.p.Reopen([]Seed{
		seed("ns", "web", "http", service.TCP, 34001),
		seed("ns", "dns", "", service.UDP, 34002),
		seed("ns", "taken", "http", service.TCP, 34003),
	})
	e.p.paths.reopen()
	// The fake sockets bind anew (no hand-over): each reopened port's socket is rebound.
	reopened, rebound, reallocated := e.p.ReopenCounts()
	if reopened != 2 || rebound != 2 || reallocated != 1 {
		t.Errorf("ReopenCounts() = %d reopened, %d rebound, %d reallocated; want 2, 2, 1", reopened, rebound, reallocated)
	}
}

func TestReopenKeepsToTheProxyPortRange(t *testing.T) {
	e := newFakeEnv(t, func(c *Config) { c.PortRange = PortRange{Base: 34000, Size: 10} })
	e.p.Reopen([]Seed{seed("ns", "web", "http", service.TCP, 34001), seed("ns", "other", "", service.TCP, 35000)})
	e.p.paths.reopen()
	if got := e.openNames(); len(got) != 1 || got[0] != "ns/web:http" {
		t.Fatalf("reopened %v, want only ns/web:http (35000 is outside 34000-34009)", got)
	}
	if pp, err := e.p.paths.ports.allocate(); err != nil || pp == 34001 {
		t.Errorf("allocate after reopen = %d, %v; want a port other than the reopened 34001", pp, err)
	}
}

func TestReopenTakenPortLeftToTheFirstSync(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.failListen[webHTTP] = fmt.Errorf("listen: %w", os.NewSyscallError("bind", syscall.EADDRINUSE)) // for good: tried for reopenInUseFor
	e.p.Reopen([]Seed{seed("ns", "web", "http", service.TCP, 34001)})
	done := make(chan struct{})
	go func() { defer close(done); e.p.paths.reopen() }()
	// The reopen tries again every 20 ms of the fake clock until reopenInUseFor has passed.
	deadline := time.Now().Add(testenv.WaitTimeout)
	for waiting := true; waiting; {
		select {
		case <-done:
			waiting = false
		case <-time.After(time.Millisecond):
			if e.clk.HasWaiters() {
				e.clk.Step(20 * time.Millisecond)
			}
			if time.Now().After(deadline) {
				t.Fatal("the reopen of a port in use for good did not give up")
			}
		}
	}
	if got := e.openNames(); len(got) != 0 {
		t.Fatalf("open = %v, want nothing (the port is taken)", got)
	}
	delete(e.failListen, webHTTP)
	e.p.OnServiceAdd(webService(nil))
	e.synced()
	e.sync()
	if s := e.open[webHTTP]; s == nil || s.addr.Port() == 34001 {
		t.Errorf("after the first sync: %v, want a socket on a newly allocated port", s)
	}
}

// TestReopenDoesNotWaitForAPortInUse: a seed whose port is still in use (the killed process's
// socket not yet gone) is tried again after the others are open, not in turn: at 10,000 ports the
// retries of one held every later port refused for up to a second after a SIGKILL.
func TestReopenDoesNotWaitForAPortInUse(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.mu.Lock()
	e.failListen[webHTTP] = fmt.Errorf("listen: %w", os.NewSyscallError("bind", syscall.EADDRINUSE))
	e.mu.Unlock()
	e.p.Reopen([]Seed{seed("ns", "web", "http", service.TCP, 34001), seed("ns", "xother", "http", service.TCP, 34002)})
	done := make(chan struct{})
	go func() { defer close(done); e.p.paths.reopen() }()
	// The fake clock stands still: only the port in use waits for it.
	testenv.WaitFor(t, "the free seed to open while the one in use waits", func() bool {
		return slices.Contains(e.openNames(), "ns/xother:http")
	})
	e.mu.Lock()
	delete(e.failListen, webHTTP) // the killed process's socket is gone
	e.mu.Unlock()
	testenv.WaitFor(t, "the seed in use to be tried again", func() bool {
		select {
		case <-done:
			return true
		default:
		}
		if e.clk.HasWaiters() {
			e.clk.Step(20 * time.Millisecond)
		}
		return false
	})
	if got := e.openNames(); !slices.Equal(got, []string{"ns/web:http", "ns/xother:http"}) {
		t.Errorf("open = %v, want both seeds", got)
	}
}

// stubPicker answers from a list the test changes.
type stubPicker struct{ eps chan netip.AddrPort }

func (s *stubPicker) Next(netip.Addr, bool) (netip.AddrPort, error) {
	select {
	case ep := <-s.eps:
		return ep, nil
	default:
		return netip.AddrPort{}, loadbalancer.ErrNoEndpoints
	}
}

// afterFirstPick runs then once, right after its first pick returns: what lands meanwhile.
type afterFirstPick struct {
	next  Picker
	then  func()
	calls int
}

func (a *afterFirstPick) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	ep, err := a.next.Next(client, reset)
	if a.calls++; a.calls == 1 {
		a.then()
	}
	return ep, err
}

func TestHoldPicker(t *testing.T) {
	ep := netip.MustParseAddrPort("10.244.1.1:8080")
	client := netip.MustParseAddr("10.0.0.2")
	tests := []struct {
		name    string
		act     func(clk *clocktesting.FakeClock, ready chan struct{}, stub *stubPicker)
		wantErr bool
	}{
		{"endpoints_arriving_release_the_connection", func(_ *clocktesting.FakeClock, ready chan struct{}, stub *stubPicker) {
			stub.eps <- ep
			close(ready)
		}, false},
		{"the_hold_ends_with_the_usual_refusal", func(clk *clocktesting.FakeClock, _ chan struct{}, _ *stubPicker) {
			clk.Step(5 * time.Second)
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := clocktesting.NewFakeClock(time.Unix(0, 0))
			ready, stub := make(chan struct{}), &stubPicker{eps: make(chan netip.AddrPort, 1)}
			h := &holdPicker{next: stub, ready: ready, done: t.Context().Done(), clock: clk, hold: 5 * time.Second}
			type result struct {
				ep  netip.AddrPort
				err error
			}
			done := make(chan result, 1)
			go func() {
				got, err := h.Next(client, false)
				done <- result{got, err}
			}()
			testenv.WaitFor(t, "the pick to wait", clk.HasWaiters)
			tt.act(clk, ready, stub)
			r := <-done
			if (r.err != nil) != tt.wantErr || (!tt.wantErr && r.ep != ep) {
				t.Errorf("Next = %v, %v; want error=%v", r.ep, r.err, tt.wantErr)
			}
		})
	}
	t.Run("endpoints_in_between_the_failed_pick_and_the_ready_check", func(t *testing.T) {
		// The window of the flaky TestBindModeReopenWithRealSockets: the first pick finds
		// nothing, then (before the holdPicker looks at ready) the initial lists land, the
		// endpoints first, then ready. The stale "no endpoints" must not be returned.
		ready := make(chan struct{})
		stub := &stubPicker{eps: make(chan netip.AddrPort, 1)}
		lands := &afterFirstPick{next: stub, then: func() { stub.eps <- ep; close(ready) }}
		h := &holdPicker{next: lands, ready: ready, clock: clocktesting.NewFakeClock(time.Unix(0, 0)), hold: time.Hour}
		if got, err := h.Next(client, false); err != nil || got != ep {
			t.Errorf("Next = %v, %v; want %v: the endpoints were in when ready was seen", got, err, ep)
		}
	})
	t.Run("after_the_initial_endpoints_no_wait", func(t *testing.T) {
		ready := make(chan struct{})
		close(ready)
		h := &holdPicker{next: &stubPicker{}, ready: ready, clock: clocktesting.NewFakeClock(time.Unix(0, 0)), hold: time.Hour}
		if _, err := h.Next(client, false); !errors.Is(err, loadbalancer.ErrNoEndpoints) {
			t.Errorf("Next = %v, want ErrNoEndpoints at once", err)
		}
	})
}
