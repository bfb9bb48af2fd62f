package tcp

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan: the package's (helpers_test.go): the proxy on 127.0.0.1, the endpoint that
// appears on 127.0.0.3.

func (f *fakePicker) setEndpoints(eps ...netip.AddrPort) {
	f.mu.Lock()
	f.eps = eps
	f.mu.Unlock()
}

func held(p *Proxy) func() int64 { return func() int64 { return p.Stats().Held } }

func waitHeld(t *testing.T, p *Proxy, n int64) {
	t.Helper()
	testenv.WaitFor(t, "held connections to reach the count", func() bool { return held(p)() == n })
}

func TestHoldServesOnceAnEndpointAppears(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			picker := &fakePicker{}
			closed := make(closedCh, 1)
			p := startProxy(t, picker, Config{HoldTimeout: time.Minute, ParkAfter: m.parkAfter, OnEnd: closed.onClose})
			c := dial(t, p)
			// The client may write at once: its bytes wait in the socket until the dial.
			if _, err := c.Write([]byte("sent while held")); err != nil {
				t.Fatalf("write while held: %v", err)
			}
			waitHeld(t, p, 1)
			p.WakeHeld() // a change that brings no endpoint: the connection stays held
			picker.setEndpoints(serve(t, "127.0.0.3", echo))
			p.WakeHeld()
			buf := make([]byte, len("sent while held"))
			if _, err := c.Read(buf); err != nil || string(buf) != "sent while held" {
				t.Fatalf("echo of the bytes sent while held: %q, %v", buf, err)
			}
			roundTrip(t, c, "after the hold")
			c.Close()
			ci := closed.next(t)
			st := p.Stats()
			if ci.End != flow.ClientClosed || st.Held != 0 || st.Holds[flow.HoldServed] != 1 || st.NoEndpoint != 0 {
				t.Errorf("end %v, held %d, holds %v, no-endpoint %d; want client-closed, 0 held, 1 served, 0",
					ci.End, st.Held, st.Holds, st.NoEndpoint)
			}
		})
	}
}

func TestHoldTimeoutResetsWithItsReason(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
	closed := make(closedCh, 1)
	p := startProxy(t, &fakePicker{}, Config{HoldTimeout: 30 * time.Second, Clock: clk, OnEnd: closed.onClose})
	c := dial(t, p)
	waitHeld(t, p, 1)
	testenv.WaitFor(t, "the hold timer", clk.HasWaiters)
	clk.Step(29 * time.Second)
	if got := held(p)(); got != 1 {
		t.Fatalf("held after 29s of a 30s hold = %d, want 1", got)
	}
	clk.Step(time.Second)
	if _, err := c.Read(make([]byte, 1)); !isReset(err) {
		t.Fatalf("client read at the hold deadline: %v, want ECONNRESET", err)
	}
	ci := closed.next(t)
	if ci.End != flow.HoldTimeout || ci.End.String() != "hold-timeout" {
		t.Errorf("end = %v, want hold-timeout", ci.End)
	}
	if st := p.Stats(); st.Holds[flow.HoldExpired] != 1 || st.Held != 0 || st.Ended[flow.HoldTimeout] != 1 {
		t.Errorf("stats: held %d, holds %v, ended %v; want 0 held, 1 timeout", st.Held, st.Holds, st.Ended)
	}
}

func TestHoldLimitResetsTheConnectionsBeyondIt(t *testing.T) {
	picker := &fakePicker{}
	closed := make(closedCh, 3)
	p := startProxy(t, picker, Config{HoldTimeout: time.Minute, HoldLimit: 2, OnEnd: closed.onClose})
	first, second := dial(t, p), dial(t, p)
	waitHeld(t, p, 2)
	if err := dialExpectReset(t, p); !isReset(err) {
		t.Fatalf("third client beyond the limit of 2: %v, want ECONNRESET", err)
	}
	if ci := closed.next(t); ci.End != flow.NoEndpoints {
		t.Errorf("end of the third = %v, want %v", ci.End, flow.NoEndpoints)
	}
	picker.setEndpoints(serve(t, "127.0.0.3", echo))
	p.WakeHeld()
	roundTrip(t, first, "first")
	roundTrip(t, second, "second")
	if st := p.Stats(); st.Holds[flow.HoldFull] != 1 || st.Holds[flow.HoldServed] != 2 || st.Held != 0 {
		t.Errorf("holds %v, held %d; want 1 full, 2 served, 0 held", st.Holds, st.Held)
	}
}

func TestHeldConnectionsAreResetWhenTheSocketCloses(t *testing.T) {
	closed := make(closedCh, 1)
	p := startProxy(t, &fakePicker{}, Config{HoldTimeout: time.Minute, OnEnd: closed.onClose})
	c := dial(t, p)
	waitHeld(t, p, 1)
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := c.Read(make([]byte, 1)); !isReset(err) {
		t.Fatalf("held client after Close: %v, want ECONNRESET", err)
	}
	if ci := closed.next(t); ci.End != flow.NoEndpoints {
		t.Errorf("end = %v, want %v", ci.End, flow.NoEndpoints)
	}
	if st := p.Stats(); st.Holds[flow.HoldAborted] != 1 {
		t.Errorf("holds %v, want 1 aborted", st.Holds)
	}
}

func TestHoldIsNotIdleTime(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
	picker := &fakePicker{}
	p := startProxy(t, picker, Config{HoldTimeout: time.Minute, IdleTimeout: 10 * time.Second, Clock: clk})
	c := dial(t, p)
	waitHeld(t, p, 1)
	testenv.WaitFor(t, "the hold timer and the idle sweeper", func() bool { return clk.Waiters() >= 2 })
	clk.Step(30 * time.Second) // three idle timeouts, but held: kept
	picker.setEndpoints(serve(t, "127.0.0.3", echo))
	p.WakeHeld()
	roundTrip(t, c, "served after a hold longer than the idle timeout")
}

func TestWithoutHoldTimeoutNoEndpointsStillResets(t *testing.T) {
	p := startProxy(t, &fakePicker{}, Config{})
	if err := dialExpectReset(t, p); !isReset(err) {
		t.Fatalf("client: %v, want ECONNRESET", err)
	}
	p.WakeHeld() // nothing held: does nothing
	if st := p.Stats(); st.Holds != [flow.NumHoldOutcomes]uint64{} || st.NoEndpoint != 1 {
		t.Errorf("holds %v, no-endpoint %d; want none, 1", st.Holds, st.NoEndpoint)
	}
}

// TestHeldClientThatGivesUpLeavesTheHold: a held client that resets, or closes before sending a
// byte, is gone at once (not at the hold timeout, nor at the dial): its place in the hold is free
// and nothing of it reaches an endpoint. A client that sent a request and then half-closed is
// still waiting for its answer: it stays held and is served.
func TestHeldClientThatGivesUpLeavesTheHold(t *testing.T) {
	for _, tc := range []struct {
		name     string
		giveUp   func(*net.TCPConn)
		wantEnd  flow.EndReason
		wantHeld bool
	}{
		{"closed_before_sending", func(c *net.TCPConn) { c.Close() }, flow.ClientClosed, false},
		{"reset_after_sending", func(c *net.TCPConn) {
			c.Write([]byte("request"))
			c.SetLinger(0)
			c.Close()
		}, flow.ClientReset, false},
		{"half_closed_after_a_request", func(c *net.TCPConn) {
			c.Write([]byte("request"))
			c.CloseWrite()
		}, flow.ClientClosed, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			picker := &fakePicker{}
			closed := make(closedCh, 1)
			// A hold timeout far longer than the test: only the watch can end the hold.
			p := startProxy(t, picker, Config{HoldTimeout: time.Hour, OnEnd: closed.onClose})
			c := dial(t, p)
			waitHeld(t, p, 1)
			tc.giveUp(c)
			if tc.wantHeld {
				// Give the watch every chance to (wrongly) end the hold: the FIN is in the
				// socket once the proxy's side is in close-wait, which the hold must survive.
				time.Sleep(50 * time.Millisecond)
				if got := held(p)(); got != 1 {
					t.Fatalf("held after a half-close with a request = %d, want 1", got)
				}
				picker.setEndpoints(serve(t, "127.0.0.3", echo))
				p.WakeHeld()
				got, err := io.ReadAll(c)
				if err != nil || string(got) != "request" {
					t.Fatalf("answer to the half-closed request: %q, %v; want the echo", got, err)
				}
				c.Close()
			}
			ci := closed.next(t)
			st := p.Stats()
			wantGone := uint64(1)
			if tc.wantHeld {
				wantGone = 0
			}
			if ci.End != tc.wantEnd || st.Held != 0 || st.Holds[flow.HoldClientGone] != wantGone {
				t.Errorf("end %v, held %d, holds %v; want %v, 0 held, %d client-gone", ci.End, st.Held, st.Holds, tc.wantEnd, wantGone)
			}
			if !tc.wantHeld && st.DialAttempts != 0 {
				t.Errorf("dial attempts = %d; want 0 (nothing dialed for a client that gave up)", st.DialAttempts)
			}
		})
	}
}
