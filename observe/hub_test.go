package observe

import (
	"net/netip"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// t0 is the tests' clock.
var t0 = time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)

func fixedClock() time.Time { return t0 }

// webEvent is the web port's Start event of flow id, at t0+id seconds (address plan in
// filter_test.go).
func webEvent(id uint64) *flow.Event {
	ap := netip.MustParseAddrPort
	return &flow.Event{Phase: flow.PhaseStart, ID: id, Time: t0.Add(time.Duration(id) * time.Second),
		Local: ap("10.96.0.10:80"), Info: flow.Info{Client: ap("10.0.1.5:40000"), Endpoint: ap("10.244.1.7:8080")}}
}

func TestNewHubDefaults(t *testing.T) {
	h := NewHub(HubConfig{})
	if len(h.slots) != DefaultRingSize || h.cfg.MaxObservers != DefaultMaxObservers ||
		h.cfg.CaptureFlowBytes != DefaultCaptureFlowBytes || h.cfg.CaptureTotalBytes != DefaultCaptureTotalBytes {
		t.Errorf("defaults: ring %d, %+v", len(h.slots), h.cfg)
	}
}

// Record copies the event and sets its port; a reader a whole ring behind is told how many it
// lost and goes on from the oldest event kept.
func TestRingOverwriteCountsLost(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 4})
	rec := h.ForPort(webPort)
	for id := uint64(1); id <= 10; id++ {
		e := webEvent(id)
		rec.Record(e)
		e.ID = 999 // the caller's event is its own again
	}
	var cursor uint64
	var e flow.Event
	ok, lost := h.next(&cursor, &e, 0xff)
	if !ok || lost != 6 || e.ID != 7 || e.Port != webPort {
		t.Fatalf("next from 0 = ok %v, lost %d, event %d port %v; want true, 6, 7, web", ok, lost, e.ID, e.Port)
	}
	for want := uint64(8); want <= 10; want++ {
		if ok, lost := h.next(&cursor, &e, 0xff); !ok || lost != 0 || e.ID != want {
			t.Fatalf("next = %v, lost %d, event %d; want event %d", ok, lost, e.ID, want)
		}
	}
	if ok, _ := h.next(&cursor, &e, 0xff); ok {
		t.Fatalf("next at the head found event %d", e.ID)
	}
	if got := h.Stats().Events; got != 10 {
		t.Errorf("Stats().Events = %d, want 10", got)
	}
}

// A writer that took its number a whole ring before another finished must not overwrite the
// newer event (a reader waiting for that slot would wait for ever, or read the wrong event).
func TestRingStaleWriterDropped(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 2})
	rec := h.ForPort(webPort)
	rec.Record(webEvent(1)) // seq 0
	rec.Record(webEvent(2)) // seq 1
	// A writer numbered seq 2 stalls; seq 3 and seq 4 (its slot) complete.
	h.head.Add(1)
	rec.Record(webEvent(4)) // seq 3
	rec.Record(webEvent(5)) // seq 4, slot 0
	// The stalled writer finishes now.
	h.put(2, webEvent(3), webPort)
	var e flow.Event
	if st := h.read(4, &e, 0xff); st != readOK || e.ID != 5 {
		t.Fatalf("read(4) = %v, event %d; want the newest event", st, e.ID)
	}
	if st := h.read(2, &e, 0xff); st != readGone {
		t.Fatalf("read(2) = %v, want readGone", st)
	}
}

// Record allocates nothing, with or without observers, asleep or reading.
func TestRecordDoesNotAllocate(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 64})
	rec := h.ForPort(webPort)
	e := webEvent(1)
	if n := testing.AllocsPerRun(1000, func() { rec.Record(e) }); n != 0 {
		t.Errorf("Record with no observer: %v allocs, want 0", n)
	}
	f, err := ParseFilter(map[string][]string{"service": {"web"}})
	if err != nil {
		t.Fatal(err)
	}
	asleep, awake := newObserver(h, f, nil, time.Time{}), newObserver(h, f, nil, time.Time{})
	h.subscribe(asleep)
	h.subscribe(awake)
	defer h.unsubscribe(asleep)
	defer h.unsubscribe(awake)
	if n := testing.AllocsPerRun(1000, func() {
		asleep.sleeping.Store(true) // so each Record pokes it
		rec.Record(e)
	}); n != 0 {
		t.Errorf("Record with observers: %v allocs, want 0", n)
	}
	if len(asleep.wake) != 1 {
		t.Errorf("the sleeping observer was not woken")
	}
	capt := rec.(flow.Capturer)
	if n := testing.AllocsPerRun(1000, func() {
		if capt.Capture(e) != nil {
			t.Fatal("Capture with no capturing observer returned a tap")
		}
	}); n != 0 {
		t.Errorf("Capture with no capturing observer: %v allocs, want 0", n)
	}
}

func TestStatsLostReasons(t *testing.T) {
	s := NewHub(HubConfig{}).Stats()
	for _, r := range []string{LostSlow, LostRate, LostCapture} {
		if n, ok := s.Lost[r]; !ok || n != 0 {
			t.Errorf("Stats().Lost[%q] = %d, %v; want 0, present", r, n, ok)
		}
	}
}
