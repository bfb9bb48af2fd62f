package observe

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Capture returns a Tap for a flow a capturing observer's filter passes, nil otherwise. With no
// capturing observer (capture off, the common case) it is one atomic load. The decision is made
// on the event the data path asks with (TCP Dial, UDP Start), with the observer's filter less
// its phase terms (they choose the events it is sent, not its flows: observe --pcap asks for End
// events only); a filter on an end verdict does not select a capture.
func (r *portRecorder) Capture(e *flow.Event) flow.Tap {
	h := r.hub
	if h.capturing.Load() == 0 {
		return nil
	}
	obs := h.observers.Load()
	if obs == nil {
		return nil
	}
	ev := *e
	ev.Port = r.port
	var targets []tapTarget
	for _, o := range *obs {
		if !o.capture || o.gone.Load() || o.captureLeft.Load() <= 0 {
			continue
		}
		if o.passFlow(&view{e: &ev, r: o.res}) {
			targets = append(targets, tapTarget{o: o, left: o.captureFlow})
		}
	}
	if len(targets) == 0 {
		return nil
	}
	h.taps.Add(1)
	return &tap{hub: h, id: e.ID, targets: targets}
}

// tap feeds one flow's payload to the observers that capture it.
type tap struct {
	hub *Hub
	id  uint64
	// mu guards targets: a TCP flow's two directions call Payload from their own goroutines.
	// It is held for a copy, never across anything that waits.
	mu      sync.Mutex
	targets []tapTarget
	closed  atomic.Bool
}

// tapTarget is one observer's share of a tap: the bytes left of the flow's cap, and whether the
// piece that reached a cap has been sent (then the flow sends it nothing more).
type tapTarget struct {
	o         *observer
	left      int
	truncated bool
}

var _ flow.Tap = (*tap)(nil)

// Payload copies what each observer may still take of b and queues it; a full queue drops the
// piece and counts it lost. It never blocks.
func (t *tap) Payload(dir flow.Direction, ts time.Time, b []byte) {
	direction := DirToEndpoint
	if dir == flow.ToClient {
		direction = DirToClient
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.targets {
		tt := &t.targets[i]
		if tt.truncated || tt.o.gone.Load() || len(b) == 0 {
			continue
		}
		want := min(len(b), tt.left)
		n := int(tt.o.take(int64(want)))
		cut := n < len(b)
		tt.left -= n
		if cut {
			// This piece is the last: mark it so a reader knows the flow went on.
			tt.truncated = true
		}
		p := &Payload{ID: t.id, Node: t.hub.cfg.Node, Time: ts, Direction: direction, Data: append([]byte(nil), b[:n]...), Truncated: cut}
		select {
		case tt.o.payloads <- p:
		default:
			tt.o.payloadsLost.Add(1)
		}
	}
}

// Close ends the tap.
func (t *tap) Close() {
	if t.closed.CompareAndSwap(false, true) {
		t.hub.taps.Add(-1)
	}
}

// take reserves up to n bytes of the observer's capture total and returns how many it got.
func (o *observer) take(n int64) int64 {
	for {
		left := o.captureLeft.Load()
		got := min(n, left)
		if got <= 0 {
			return 0
		}
		if o.captureLeft.CompareAndSwap(left, left-got) {
			return got
		}
	}
}
