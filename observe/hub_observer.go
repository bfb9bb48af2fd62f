package observe

import (
	"sync/atomic"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// observer is one /debug/flows request: its filter and its cursor's wake-up. The request's
// goroutine reads the ring; writers only poke it.
type observer struct {
	hub    *Hub
	filter *Filter
	res    Resolver
	since  time.Time // zero: no bound
	// phases are the phases the filter may pass (Filter.phases; all without a filter).
	phases uint8

	// wake (capacity 1) is poked by a writer only while the observer sleeps, so a writer pays a
	// channel send only when it has something to say.
	wake     chan struct{}
	sleeping atomic.Bool
	// gone is set when the observer unsubscribes: taps stop feeding it.
	gone atomic.Bool

	// Capture (capture=1): the per-flow cap, the bytes left of the observer's total, and the
	// bounded queue taps put payload on (dropping, and counting, when it is full).
	capture      bool
	captureFlow  int
	captureLeft  atomic.Int64
	payloads     chan *Payload
	payloadsLost atomic.Uint64
}

// payloadQueue bounds an observer's pending payload pieces.
const payloadQueue = 1024

func newObserver(h *Hub, f *Filter, r Resolver, since time.Time) *observer {
	phases := uint8(1<<flow.NumPhases - 1)
	if f != nil {
		phases = f.phases
	}
	return &observer{hub: h, filter: f, res: r, since: since, phases: phases, wake: make(chan struct{}, 1)}
}

// poke wakes the observer if it sleeps. It never blocks.
func (o *observer) poke() {
	if o.sleeping.Load() && o.sleeping.CompareAndSwap(true, false) {
		select {
		case o.wake <- struct{}{}:
		default:
		}
	}
}

// next copies the event at *cursor into e and advances the cursor. ok is false when there is
// nothing to read yet: the cursor is at the head, or the event there is still being written.
// lost counts the events skipped because writers overtook the cursor.
func (h *Hub) next(cursor *uint64, e *flow.Event, phases uint8) (ok bool, lost uint64) {
	for {
		head := h.head.Load()
		if *cursor >= head {
			return false, lost
		}
		if old := h.oldest(head); *cursor < old {
			lost += old - *cursor
			*cursor = old
		}
		switch h.read(*cursor, e, phases) {
		case readOK:
			*cursor++
			return true, lost
		case readPending:
			return false, lost
		case readSkipped:
			*cursor++
			continue
		}
		// readGone: overwritten since head was loaded; the next head is far enough on to skip it.
	}
}

// ready reports whether next would find an event (or a loss) at cursor.
func (h *Hub) ready(cursor uint64) bool {
	head := h.head.Load()
	if cursor >= head {
		return false
	}
	if cursor < h.oldest(head) {
		return true
	}
	s := &h.slots[cursor%uint64(len(h.slots))]
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seq > cursor
}

// startLast is where to start reading to get the last n events, before head, that the
// observer's filter passes: a scan backwards over the ring.
func (o *observer) startLast(head uint64, n int) uint64 {
	h := o.hub
	old := h.oldest(head)
	var e flow.Event
	found := 0
	for seq := head; seq > old; {
		if found >= n {
			return seq
		}
		seq--
		switch h.read(seq, &e, o.phases) {
		case readGone:
			return seq + 1 // the older ones are gone too
		case readPending, readSkipped:
			continue
		}
		if o.pass(&view{e: &e, r: o.res}) {
			found++
		}
	}
	return old
}

// pass reports whether the observer wants the event.
func (o *observer) pass(v *view) bool {
	if !o.since.IsZero() && v.e.Time.Before(o.since) {
		return false
	}
	return o.filter.match(v)
}

// passFlow reports whether v's flow is one o's filter selects, whatever the event's phase.
func (o *observer) passFlow(v *view) bool {
	if !o.since.IsZero() && v.e.Time.Before(o.since) {
		return false
	}
	return o.filter.matchFlow(v)
}
