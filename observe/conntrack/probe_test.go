package conntrack

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	ct "github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// getter is an entryGetter that answers from a script and records what it was asked.
type getter struct {
	asked  []string // "client->local" of each GET
	answer func(f ct.Flow) (ct.Flow, error)
}

func (g *getter) Get(f ct.Flow) (ct.Flow, error) {
	o := f.TupleOrig
	g.asked = append(g.asked, netip.AddrPortFrom(o.IP.SourceAddress, o.Proto.SourcePort).String()+"->"+
		netip.AddrPortFrom(o.IP.DestinationAddress, o.Proto.DestinationPort).String())
	return g.answer(f)
}

// tcpIn answers with the entry in a TCP state and seconds left.
func tcpIn(id uint32, state uint8, left uint32) func(ct.Flow) (ct.Flow, error) {
	return func(f ct.Flow) (ct.Flow, error) {
		f.ID, f.Timeout = id, left
		f.ProtoInfo.TCP = &ct.ProtoInfoTCP{State: state}
		return f, nil
	}
}

func gone(ct.Flow) (ct.Flow, error) { return ct.Flow{}, unix.ENOENT }

func probeReader(t *testing.T, c *clock, g *getter, rate int, log *testenv.SyncBuffer) (*reader, *events) {
	t.Helper()
	rec := &events{}
	logger := logrus.New()
	logger.SetOutput(log)
	w := NewWatcher(ports{{flow.TCP, svcTCP}: rec}, Options{Now: c.now, MaxProbeRate: rate, Logger: logger})
	return newReader(w, g), rec
}

// wantWake checks when the reader would next probe.
func wantWake(t *testing.T, r *reader, want time.Time) {
	t.Helper()
	got, ok := r.wake()
	if want.IsZero() {
		if ok {
			t.Fatalf("next probe at %v, want none", got)
		}
		return
	}
	if !ok || !got.Equal(want) {
		t.Fatalf("next probe at %v (scheduled %v), want %v", got, ok, want)
	}
}

// TestProbesFollowAnEntryUntilItIsGone: a started entry is asked for 5 s after its NEW; one
// found in TIME_WAIT with 3 s left is asked again just after those run out; the GET that finds it
// gone schedules nothing more. The GETs name the entry's original tuple.
func TestProbesFollowAnEntryUntilItIsGone(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	g := &getter{}
	var log testenv.SyncBuffer
	r, _ := probeReader(t, c, g, 0, &log)
	t0 := c.t
	r.start(entry(7, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String()))
	wantWake(t, r, t0.Add(5*time.Second))

	c.t = t0.Add(4 * time.Second)
	g.answer = func(ct.Flow) (ct.Flow, error) { t.Fatal("asked before the probe was due"); return ct.Flow{}, nil }
	r.probe()

	c.t = t0.Add(5 * time.Second)
	g.answer = tcpIn(7, tcpTimeWait, 3)
	r.probe()
	wantWake(t, r, c.t.Add(4*time.Second))

	c.t = c.t.Add(4 * time.Second)
	g.answer = gone
	r.probe()
	wantWake(t, r, time.Time{})
	want := []string{"10.100.0.2:40000->10.96.0.10:80", "10.100.0.2:40000->10.96.0.10:80"}
	if d := cmp.Diff(want, g.asked); d != "" {
		t.Errorf("GETs (-want +got):\n%s", d)
	}
	if st := r.w.Stats(); st.Probes != 2 {
		t.Errorf("%d probes counted, want 2", st.Probes)
	}
}

// TestProbesRecheckEstablishedEntries: an established entry (days left) is asked again every
// ProbeInterval, not when its timeout would run out; a DESTROY takes its probe out; an entry on
// the same tuple with another id is not the one started, and is not followed.
func TestProbesRecheckEstablishedEntries(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	g := &getter{answer: tcpIn(7, tcpEstablished, 431999)}
	var log testenv.SyncBuffer
	r, rec := probeReader(t, c, g, 0, &log)
	e := entry(7, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String())
	r.start(e)
	c.t = c.t.Add(5 * time.Second)
	r.probe()
	wantWake(t, r, c.t.Add(5*time.Second))
	r.end(e)
	wantWake(t, r, time.Time{})
	if n := len(rec.get()); n != 2 {
		t.Fatalf("%d events, want the Start and the End", n)
	}

	r.start(e)
	c.t = c.t.Add(5 * time.Second)
	g.answer = tcpIn(8, tcpEstablished, 431999)
	r.probe()
	wantWake(t, r, time.Time{})
}

// TestProbesKeepToTheirRate: with 5 entries due and a rate of 2 a second, one pass asks for 2,
// and the next may go half a second later; the others follow as the budget refills.
func TestProbesKeepToTheirRate(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	g := &getter{answer: gone}
	var log testenv.SyncBuffer
	r, _ := probeReader(t, c, g, 2, &log)
	for i := range 5 {
		r.start(entry(uint32(i+1), unix.IPPROTO_TCP, fmt.Sprintf("10.100.0.2:%d", 40000+i), svcTCP.String(), epTCP.String()))
	}
	c.t = c.t.Add(5 * time.Second)
	r.probe()
	if len(g.asked) != 2 {
		t.Fatalf("%d GETs in one pass, want 2 (the rate)", len(g.asked))
	}
	wantWake(t, r, c.t.Add(500*time.Millisecond))
	c.t = c.t.Add(500 * time.Millisecond)
	r.probe()
	if len(g.asked) != 3 {
		t.Fatalf("%d GETs after half a second more, want 3", len(g.asked))
	}
	c.t = c.t.Add(10 * time.Second) // the budget holds at most a second's worth
	r.probe()
	if len(g.asked) != 5 {
		t.Fatalf("%d GETs in all, want 5", len(g.asked))
	}
}

// TestProbesStopOnAnError: a GET that fails other than "no such entry" turns probing off, said
// once; the flows still start and end from the events.
func TestProbesStopOnAnError(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	g := &getter{answer: func(ct.Flow) (ct.Flow, error) { return ct.Flow{}, errors.New("operation not permitted") }}
	var log testenv.SyncBuffer
	r, rec := probeReader(t, c, g, 0, &log)
	e := entry(7, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String())
	r.start(e)
	c.t = c.t.Add(5 * time.Second)
	r.probe()
	r.probe()
	wantWake(t, r, time.Time{})
	if n := strings.Count(log.String(), "cannot look conntrack entries up"); n != 1 {
		t.Errorf("said %d times, want once:\n%s", n, log.String())
	}
	r.start(entry(8, unix.IPPROTO_TCP, "10.100.0.2:40001", svcTCP.String(), epTCP.String()))
	r.end(e)
	if n := len(rec.get()); n != 3 {
		t.Errorf("%d events, want 3", n)
	}
}
