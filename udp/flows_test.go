package udp

// Address plan: the package's (helpers_test.go): the proxy on 127.0.0.1, echo endpoints on
// 127.0.0.2, a closed endpoint on 127.0.0.9, clients on 127.0.0.1; loopback only.

import (
	"bytes"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// flowLog is a Recorder that keeps a copy of every event, and, capturing, a tap per session.
type flowLog struct {
	mu      sync.Mutex
	evs     []flow.Event
	capture bool
	taps    []*tap
}

func (l *flowLog) Record(e *flow.Event) {
	l.mu.Lock()
	l.evs = append(l.evs, *e)
	l.mu.Unlock()
}

func (l *flowLog) Capture(e *flow.Event) flow.Tap {
	if !l.capture {
		return nil
	}
	t := &tap{}
	l.mu.Lock()
	l.taps = append(l.taps, t)
	l.mu.Unlock()
	return t
}

type tap struct {
	mu     sync.Mutex
	dirs   [2]bytes.Buffer
	closed bool
}

func (t *tap) Payload(dir flow.Direction, _ time.Time, b []byte) {
	t.mu.Lock()
	t.dirs[dir].Write(b)
	t.dirs[dir].WriteByte('|')
	t.mu.Unlock()
}

func (t *tap) Close() { t.mu.Lock(); t.closed = true; t.mu.Unlock() }

// until waits for cond on the events and returns them.
func (l *flowLog) until(t *testing.T, what string, cond func([]flow.Event) bool) []flow.Event {
	t.Helper()
	var out []flow.Event
	testenv.WaitFor(t, what, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		out = append(out[:0], l.evs...)
		return cond(out)
	})
	return out
}

func ends(n int) func([]flow.Event) bool {
	return func(evs []flow.Event) bool {
		k := 0
		for _, e := range evs {
			if e.Phase == flow.PhaseEnd {
				k++
			}
		}
		return k >= n
	}
}

func summary(evs []flow.Event) string {
	var b bytes.Buffer
	ids := map[uint64]int{}
	for i, e := range evs {
		if _, ok := ids[e.ID]; !ok {
			ids[e.ID] = len(ids) + 1
		}
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%d:%s", ids[e.ID], e.Phase)
		if e.Phase == flow.PhaseEnd {
			fmt.Fprintf(&b, "/%s", e.Verdict())
		}
	}
	return b.String()
}

// explainer is a fakePicker that explains its picks.
type explainer struct{ *fakePicker }

func (e explainer) NextWhy(client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	ep, err := e.Next(client, reset)
	pk := flow.Pick{Algorithm: flow.Random, Why: flow.Topology}
	if reset {
		pk.Why |= flow.Retry
	}
	return ep, pk, err
}

func TestFlowEventsOfASession(t *testing.T) {
	ep := echoServer(t, "127.0.0.2", "")
	log := &flowLog{capture: true}
	p := startProxy(t, explainer{newFakePicker(ep)}, Config{Flows: log})
	c := newClient(t, "127.0.0.1", p.Addr())
	c.roundTrip("one")
	c.roundTrip("two!")
	p.DropEndpoint(ep)
	evs := log.until(t, "the session to end", ends(1))
	if got, want := summary(evs), "1:start 1:end/ejected"; got != want {
		t.Fatalf("events %q, want %q", got, want)
	}
	wantPick := flow.Pick{Algorithm: flow.Random, Why: flow.Topology}
	for _, e := range evs {
		if e.ID == 0 || e.Port != nil || e.Client != c.addr() || e.Endpoint != ep || e.Local != p.Addr() ||
			e.Pick != wantPick || !e.Source.Addr().IsLoopback() || e.Source.Port() == 0 || e.Time.IsZero() {
			t.Errorf("%s: %+v; want client %s, endpoint %s, local %s, pick %+v, a loopback source, no Port", e.Phase, e, c.addr(), ep, p.Addr(), wantPick)
		}
	}
	if e := evs[1]; e.PacketsToEndpoint != 2 || e.PacketsToClient != 2 || e.BytesToEndpoint != 7 || e.BytesToClient != 7 {
		t.Errorf("end: packets %d/%d bytes %d/%d; want 2/2, 7/7", e.PacketsToEndpoint, e.PacketsToClient, e.BytesToEndpoint, e.BytesToClient)
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	if len(log.taps) != 1 {
		t.Fatalf("%d taps, want 1", len(log.taps))
	}
	tp := log.taps[0]
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if up, down := tp.dirs[flow.ToEndpoint].String(), tp.dirs[flow.ToClient].String(); up != "one|two!|" || down != "one|two!|" || !tp.closed {
		t.Errorf("tap: to endpoint %q, to client %q, closed %v; want each datagram each way, closed", up, down, tp.closed)
	}
}

func TestFlowEventsOfEndedAndRefusedSessions(t *testing.T) {
	t.Run("evicted", func(t *testing.T) {
		ep := echoServer(t, "127.0.0.2", "")
		log := &flowLog{}
		p := startProxy(t, newFakePicker(ep), Config{Flows: log, MaxSessions: 1, Loops: 1})
		c1 := newClient(t, "127.0.0.1", p.Addr())
		c2 := newClient(t, "127.0.0.1", p.Addr())
		c1.roundTrip("1")
		c2.roundTrip("2")
		evs := log.until(t, "the eviction", ends(1))
		if got, want := summary(evs), "1:start 1:end/evicted 2:start"; got != want {
			t.Fatalf("events %q, want %q", got, want)
		}
		if evs[1].Client != c1.addr() || evs[1].End != flow.Evicted || evs[1].Pick != (flow.Pick{}) {
			t.Errorf("end: %+v; want c1 %s evicted, round robin with no reason (no explainer)", evs[1], c1.addr())
		}
	})
	t.Run("unreachable_then_retried", func(t *testing.T) {
		dead := closedPort(t, "127.0.0.9")
		live := echoServer(t, "127.0.0.2", "live:")
		log := &flowLog{}
		p := startProxy(t, explainer{newFakePicker(dead, live)}, Config{Flows: log})
		c := newClient(t, "127.0.0.1", p.Addr())
		c.send([]byte("lost"))
		log.until(t, "the refusal", ends(1))
		if got := c.roundTrip("retry"); got != "live:retry" {
			t.Fatalf("after the refusal: %q", got)
		}
		evs := log.until(t, "the second start", func(evs []flow.Event) bool { return len(evs) >= 3 })
		if got, want := summary(evs), "1:start 1:end/unreachable 2:start"; got != want {
			t.Fatalf("events %q, want %q", got, want)
		}
		if e := evs[0]; e.Endpoint != dead {
			t.Errorf("first session's endpoint %s, want %s", e.Endpoint, dead)
		}
		if e := evs[2]; e.Endpoint != live || e.Pick.Why != flow.Topology|flow.Retry {
			t.Errorf("second session: endpoint %s, pick %+v; want %s, a retry", e.Endpoint, e.Pick, live)
		}
	})
	t.Run("no_endpoint", func(t *testing.T) {
		log := &flowLog{}
		p := startProxy(t, newFakePicker(), Config{Flows: log})
		c := newClient(t, "127.0.0.1", p.Addr())
		c.send([]byte("nobody home"))
		evs := log.until(t, "the drop", ends(1))
		if got, want := summary(evs), "1:end/refused"; got != want {
			t.Fatalf("events %q, want %q", got, want)
		}
		if e := evs[0]; e.Client != c.addr() || e.Endpoint.IsValid() || e.Local != p.Addr() || e.ID == 0 {
			t.Errorf("end: %+v; want client %s, no endpoint, local %s", e, c.addr(), p.Addr())
		}
	})
	t.Run("source_denied", func(t *testing.T) {
		log := &flowLog{}
		ep := echoServer(t, "127.0.0.2", "")
		p := startProxy(t, newFakePicker(ep), Config{Flows: log, Allow: func(netip.Addr) bool { return false }})
		c := newClient(t, "127.0.0.1", p.Addr())
		c.send([]byte("denied"))
		evs := log.until(t, "the denial", ends(1))
		if got, want := summary(evs), "1:end/source-denied"; got != want {
			t.Fatalf("events %q, want %q", got, want)
		}
	})
}
