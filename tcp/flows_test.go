package tcp

// Address plan: the package's (helpers_test.go): the proxy on 127.0.0.1, endpoints on
// 127.0.0.3, refused dials to 127.0.0.2, a denied client on 127.0.0.5; loopback only.

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// flowLog is a Recorder that keeps a copy of every event, as the hub does.
type flowLog struct {
	mu  sync.Mutex
	evs []flow.Event
}

func (l *flowLog) Record(e *flow.Event) {
	l.mu.Lock()
	l.evs = append(l.evs, *e)
	l.mu.Unlock()
}

// ended waits for n End events and returns every event recorded, in order.
func (l *flowLog) ended(t *testing.T, n int) []flow.Event {
	t.Helper()
	var out []flow.Event
	testenv.WaitFor(t, fmt.Sprintf("%d flows to end", n), func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		ends := 0
		for _, e := range l.evs {
			if e.Phase == flow.PhaseEnd {
				ends++
			}
		}
		out = append(out[:0], l.evs...)
		return ends >= n
	})
	return out
}

// explainer is a fakePicker that explains its picks: least connections, with why, plus Retry
// on a retry.
type explainer struct {
	*fakePicker
	why flow.PickWhy
}

func (e explainer) NextWhy(client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	ep, err := e.Next(client, reset)
	pk := flow.Pick{Algorithm: flow.LeastConnections, Why: e.why}
	if reset {
		pk.Why |= flow.Retry
	}
	return ep, pk, err
}

func phases(evs []flow.Event) string {
	var b bytes.Buffer
	for i, e := range evs {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s", e.Phase)
	}
	return b.String()
}

// checkFlow checks the events of one flow: the phases in order, one ID (never 0) and no Port
// (the per-port recorder sets it), the verdict and end reason of the End, and each event's
// own fields through check.
func checkFlow(t *testing.T, evs []flow.Event, want string, end flow.EndReason, verdict flow.Verdict) {
	t.Helper()
	if got := phases(evs); got != want {
		t.Fatalf("phases %q, want %q; events:\n%+v", got, want, evs)
	}
	for _, e := range evs {
		if e.ID == 0 || e.ID != evs[0].ID || e.Port != nil {
			t.Errorf("%s event: ID %d (first %d), Port %v; want one non-zero ID and no Port", e.Phase, e.ID, evs[0].ID, e.Port)
		}
		if e.Time.IsZero() {
			t.Errorf("%s event without a time", e.Phase)
		}
	}
	last := evs[len(evs)-1]
	if last.End != end || last.Verdict() != verdict {
		t.Errorf("End: reason %v, verdict %v; want %v, %v (err %v)", last.End, last.Verdict(), end, verdict, last.Err)
	}
}

func byPhase(evs []flow.Event, ph flow.Phase) flow.Event {
	for _, e := range evs {
		if e.Phase == ph {
			return e
		}
	}
	return flow.Event{}
}

func TestFlowEventsOfARequest(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			source := make(chan netip.AddrPort, 1)
			ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
				source <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
				echo(c)
			})
			log := &flowLog{}
			pk := explainer{&fakePicker{eps: []netip.AddrPort{ep}}, flow.Affinity}
			p := startProxy(t, pk, Config{Flows: log, ParkAfter: m.parkAfter})
			c := dial(t, p)
			roundTrip(t, c, "request")
			c.CloseWrite()
			if _, err := io.ReadAll(c); err != nil {
				t.Fatalf("read to EOF: %v", err)
			}
			evs := log.ended(t, 1)
			checkFlow(t, evs, "start dial first-byte end", flow.ClientClosed, flow.Forwarded)
			client := c.LocalAddr().(*net.TCPAddr).AddrPort()
			wantPick := flow.Pick{Algorithm: flow.LeastConnections, Why: flow.Affinity}
			for _, e := range evs {
				if e.Client != client || e.Endpoint != ep || e.Local != p.Addr() || e.Pick != wantPick {
					t.Errorf("%s: client %s endpoint %s local %s pick %+v; want %s %s %s %+v",
						e.Phase, e.Client, e.Endpoint, e.Local, e.Pick, client, ep, p.Addr(), wantPick)
				}
			}
			if s := byPhase(evs, flow.PhaseStart); s.Source.IsValid() || s.ConnectLatency != 0 {
				t.Errorf("start: source %s, connect latency %s before the dial", s.Source, s.ConnectLatency)
			}
			d := byPhase(evs, flow.PhaseDial)
			if want := <-source; d.Source != want || d.DialAttempts != 1 || d.ConnectLatency <= 0 {
				t.Errorf("dial: source %s, attempts %d, latency %s; want %s (the endpoint's peer), 1, > 0",
					d.Source, d.DialAttempts, d.ConnectLatency, want)
			}
			fb := byPhase(evs, flow.PhaseFirstByte)
			if fb.FirstByte <= 0 || fb.Source != d.Source {
				t.Errorf("first byte after %s, source %s; want > 0, %s", fb.FirstByte, fb.Source, d.Source)
			}
			end := evs[3]
			if n := uint64(len("request")); end.BytesToEndpoint != n || end.BytesToClient != n || end.Err != nil ||
				end.FirstByte != fb.FirstByte || end.ConnectLatency != d.ConnectLatency {
				t.Errorf("end: bytes %d/%d, err %v, first byte %s, latency %s; want %d each way, nil, %s, %s",
					end.BytesToEndpoint, end.BytesToClient, end.Err, end.FirstByte, end.ConnectLatency, n, fb.FirstByte, d.ConnectLatency)
			}
		})
	}
}

func TestFlowEventsOfRefusedAndFailedFlows(t *testing.T) {
	t.Run("no_endpoints_ends_only", func(t *testing.T) {
		log := &flowLog{}
		p := startProxy(t, &fakePicker{}, Config{Flows: log})
		if err := dialExpectReset(t, p); !isReset(err) {
			t.Fatalf("client: %v, want a reset", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "end", flow.NoEndpoints, flow.Refused)
		if e := evs[0]; e.Endpoint.IsValid() || e.DialAttempts != 0 || e.Local != p.Addr() {
			t.Errorf("end: endpoint %s, attempts %d, local %s; want none, 0, %s", e.Endpoint, e.DialAttempts, e.Local, p.Addr())
		}
	})
	t.Run("dial_failed", func(t *testing.T) {
		log := &flowLog{}
		a, b := refusedPort(t), refusedPort(t)
		p := startProxy(t, explainer{&fakePicker{eps: []netip.AddrPort{a, b}}, 0},
			Config{Flows: log, DialTimeouts: []time.Duration{time.Second, time.Second}})
		if err := dialExpectReset(t, p); !isReset(err) {
			t.Fatalf("client: %v, want a reset", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "start end", flow.DialFailed, flow.DialFailedV)
		s, e := evs[0], evs[1]
		if s.Endpoint != a || s.DialAttempts != 1 || s.Pick.Why != 0 {
			t.Errorf("start: endpoint %s, attempts %d, pick %+v; want %s, 1, no reason", s.Endpoint, s.DialAttempts, s.Pick, a)
		}
		if e.Endpoint != b || e.DialAttempts != 2 || e.Pick.Why != flow.Retry || e.Err == nil {
			t.Errorf("end: endpoint %s, attempts %d, pick %+v, err %v; want %s, 2, retry, an error", e.Endpoint, e.DialAttempts, e.Pick, e.Err, b)
		}
	})
	t.Run("source_denied", func(t *testing.T) {
		log := &flowLog{}
		picker := &fakePicker{eps: []netip.AddrPort{serve(t, "127.0.0.3", echo)}}
		denied := netip.MustParseAddr("127.0.0.5")
		p := startProxy(t, picker, Config{Flows: log, Allow: func(a netip.Addr) bool { return a != denied }})
		c, err := dialFrom(t, "127.0.0.5", p)
		if err == nil {
			_, err = c.Read(make([]byte, 1))
		}
		if !isReset(err) {
			t.Fatalf("denied client: %v, want a reset", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "end", flow.SourceDenied, flow.Denied)
		if e := evs[0]; e.Client.Addr() != denied || e.Endpoint.IsValid() || e.Local != p.Addr() {
			t.Errorf("end: client %s, endpoint %s, local %s; want %s, none, %s", e.Client, e.Endpoint, e.Local, denied, p.Addr())
		}
	})
	t.Run("endpoint_reset", func(t *testing.T) {
		ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
			io.ReadFull(c, make([]byte, 4))
			c.SetLinger(0)
		})
		log := &flowLog{}
		p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Flows: log})
		c := dial(t, p)
		c.Write([]byte("ping"))
		if _, err := io.ReadAll(c); !isReset(err) {
			t.Fatalf("client read after endpoint RST: %v, want ECONNRESET", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "start dial end", flow.EndpointReset, flow.Reset)
		if e := evs[2]; e.BytesToEndpoint != 4 || e.Err == nil || e.Pick != (flow.Pick{}) {
			t.Errorf("end: bytes to endpoint %d, err %v, pick %+v; want 4, an error, round robin (no explainer)", e.BytesToEndpoint, e.Err, e.Pick)
		}
	})
	t.Run("shutdown", func(t *testing.T) {
		// The proxy stopping ends its established connections: verdict closed.
		ep := serve(t, "127.0.0.3", echo)
		log := &flowLog{}
		p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Flows: log})
		c := dial(t, p)
		roundTrip(t, c, "live")
		p.Shutdown()
		if _, err := io.ReadAll(c); err != nil && !isReset(err) {
			t.Fatalf("client read after Shutdown: %v, want EOF or a reset", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "start dial first-byte end", flow.Shutdown, flow.Closed)
		if e := evs[3]; e.BytesToEndpoint != 4 || e.BytesToClient != 4 {
			t.Errorf("end: bytes %d/%d, want 4/4", e.BytesToEndpoint, e.BytesToClient)
		}
	})
	t.Run("idle_timeout", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
		ep := serve(t, "127.0.0.3", echo)
		log := &flowLog{}
		p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Flows: log, IdleTimeout: 10 * time.Second, Clock: clk})
		c := dial(t, p)
		roundTrip(t, c, "active")
		testenv.WaitFor(t, "the idle sweeper to start", clk.HasWaiters)
		clk.Step(11 * time.Second)
		if _, err := c.Read(make([]byte, 1)); err != io.EOF {
			t.Fatalf("client read after idle timeout: %v; want EOF", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "start dial first-byte end", flow.IdleTimeout, flow.Timeout)
		if e := evs[3]; e.Time != time.Unix(1011, 0) || e.Duration != 11*time.Second {
			t.Errorf("end at %s after %s; want the proxy clock's %s, 11s", e.Time, e.Duration, time.Unix(1011, 0))
		}
	})
}

func TestFlowEventsOfHeldFlows(t *testing.T) {
	t.Run("served", func(t *testing.T) {
		picker := &fakePicker{}
		log := &flowLog{}
		p := startProxy(t, picker, Config{Flows: log, HoldTimeout: time.Minute})
		c := dial(t, p)
		waitHeld(t, p, 1)
		ep := serve(t, "127.0.0.3", echo)
		picker.setEndpoints(ep)
		p.WakeHeld()
		roundTrip(t, c, "after the hold")
		c.Close()
		evs := log.ended(t, 1)
		checkFlow(t, evs, "held dial first-byte end", flow.ClientClosed, flow.Forwarded)
		if h := evs[0]; h.Endpoint.IsValid() || h.Verdict() != flow.Held {
			t.Errorf("held: endpoint %s, verdict %v; want none, held", h.Endpoint, h.Verdict())
		}
		if d := evs[1]; d.Endpoint != ep || !d.Source.IsValid() {
			t.Errorf("dial: endpoint %s, source %s; want %s and the dialed socket's address", d.Endpoint, d.Source, ep)
		}
	})
	t.Run("timeout", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
		log := &flowLog{}
		p := startProxy(t, &fakePicker{}, Config{Flows: log, HoldTimeout: 30 * time.Second, Clock: clk})
		c := dial(t, p)
		waitHeld(t, p, 1)
		testenv.WaitFor(t, "the hold timer", clk.HasWaiters)
		clk.Step(30 * time.Second)
		if _, err := c.Read(make([]byte, 1)); !isReset(err) {
			t.Fatalf("client read at the hold deadline: %v, want ECONNRESET", err)
		}
		evs := log.ended(t, 1)
		checkFlow(t, evs, "held end", flow.HoldTimeout, flow.Held)
	})
}

// capturer is a flowLog that captures every flow into taps of its own.
type capturer struct {
	flowLog
	mu   sync.Mutex
	taps []*tap
}

type tap struct {
	mu     sync.Mutex
	dirs   [2]bytes.Buffer
	closed bool
}

func (c *capturer) Capture(e *flow.Event) flow.Tap {
	t := &tap{}
	c.mu.Lock()
	c.taps = append(c.taps, t)
	c.mu.Unlock()
	return t
}

func (t *tap) Payload(dir flow.Direction, _ time.Time, b []byte) {
	t.mu.Lock()
	t.dirs[dir].Write(b)
	t.mu.Unlock()
}

func (t *tap) Close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
}

// TestCapturedFlowTapsEveryByte: a captured connection's tap gets exactly the bytes moved each
// way, bulk included (which an uncaptured connection splices), and is closed after End.
func TestCapturedFlowTapsEveryByte(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			up := make([]byte, 3<<20+17)
			for i := range up {
				up[i] = byte(i * 7)
			}
			greeting := []byte("hello from the endpoint")
			ep := serve(t, "127.0.0.3", func(c *net.TCPConn) {
				c.Write(greeting)
				io.Copy(io.Discard, c)
				c.Write(up[:1<<20]) // a bulk answer
				c.CloseWrite()
			})
			rec := &capturer{}
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Flows: rec, ParkAfter: m.parkAfter})
			c := dial(t, p)
			if _, err := io.ReadFull(c, make([]byte, len(greeting))); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Write(up); err != nil {
				t.Fatal(err)
			}
			c.CloseWrite()
			got, err := io.ReadAll(c)
			if err != nil || len(got) != 1<<20 {
				t.Fatalf("answer: %d bytes, %v", len(got), err)
			}
			rec.ended(t, 1)
			rec.mu.Lock()
			defer rec.mu.Unlock()
			if len(rec.taps) != 1 {
				t.Fatalf("%d taps, want 1", len(rec.taps))
			}
			tp := rec.taps[0]
			testenv.WaitFor(t, "the tap to close", func() bool { tp.mu.Lock(); defer tp.mu.Unlock(); return tp.closed })
			tp.mu.Lock()
			defer tp.mu.Unlock()
			if !bytes.Equal(tp.dirs[flow.ToEndpoint].Bytes(), up) {
				t.Errorf("tap to endpoint: %d bytes, want the %d sent", tp.dirs[flow.ToEndpoint].Len(), len(up))
			}
			if want := append(append([]byte{}, greeting...), up[:1<<20]...); !bytes.Equal(tp.dirs[flow.ToClient].Bytes(), want) {
				t.Errorf("tap to client: %d bytes, want the %d answered", tp.dirs[flow.ToClient].Len(), len(want))
			}
		})
	}
}
