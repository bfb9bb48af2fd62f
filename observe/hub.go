package observe

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// HubConfig configures a Hub. Zero fields take the defaults noted.
type HubConfig struct {
	// RingSize is how many recent events the ring keeps (default 8192). Its memory is allocated
	// once, by NewHub.
	RingSize int
	// MaxObservers caps the /debug/flows requests served at once (default 16); one more gets 429.
	MaxObservers int
	// MaxRate caps each observer's events per second (0: unlimited). A request's rate= is
	// lowered to it.
	MaxRate int
	// Capture lets observers ask for payload (capture=1); off, such a request gets 403.
	Capture bool
	// CaptureFlowBytes caps the payload captured per flow and observer (default 65536); a
	// request's capture_bytes= is lowered to it.
	CaptureFlowBytes int
	// CaptureTotalBytes caps the payload one observer is sent in all (default 64 MiB).
	CaptureTotalBytes int64
	// Node names this proxy's node in the stream's lost and payload items (flow items carry
	// their port's).
	Node string
	// Clock is the time source (default time.Now); tests inject one.
	Clock func() time.Time
}

// The defaults of HubConfig.
const (
	DefaultRingSize          = 8192
	DefaultMaxObservers      = 16
	DefaultCaptureFlowBytes  = 64 << 10
	DefaultCaptureTotalBytes = 64 << 20
)

func (c HubConfig) withDefaults() HubConfig {
	if c.RingSize <= 0 {
		c.RingSize = DefaultRingSize
	}
	if c.MaxObservers <= 0 {
		c.MaxObservers = DefaultMaxObservers
	}
	if c.MaxRate < 0 {
		c.MaxRate = 0
	}
	if c.CaptureFlowBytes <= 0 {
		c.CaptureFlowBytes = DefaultCaptureFlowBytes
	}
	if c.CaptureTotalBytes <= 0 {
		c.CaptureTotalBytes = DefaultCaptureTotalBytes
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	return c
}

// Hub keeps the recent flow events of every port in a fixed ring and serves them to observers
// (Handler). The data path writes through the Recorders ForPort returns: a write copies the event
// into a slot and never waits for an observer; an observer that falls a whole ring behind loses
// the events it missed and is told how many.
type Hub struct {
	cfg   HubConfig
	slots []slot

	// head counts the events ever written: the next event's sequence number.
	head atomic.Uint64

	// observers is the copy-on-write list of the observers connected now, nil when none, so a
	// write with no observer costs one atomic load. mu serialises its writers.
	mu        sync.Mutex
	observers atomic.Pointer[[]*observer]
	// admitted counts the observers admitted (a slot of MaxObservers), capturing those that asked
	// for payload.
	admitted  atomic.Int32
	capturing atomic.Int32
	// taps counts the flows being captured now.
	taps atomic.Int64

	lost [numLostReasons]atomic.Uint64

	// writeStall ends an observer whose batch takes longer to write (a client that stopped
	// reading); tests shorten it.
	writeStall time.Duration
	// coalesce is how long a woken observer waits for more events before reading (0: none).
	coalesce time.Duration
}

// slot holds one event. Its mutex makes the copy in and the copy out atomic to each other; it is
// held only for the copy, so a writer waits at most for one other copy of this slot.
type slot struct {
	mu sync.Mutex
	// seq is the event's sequence number plus one (0: never written).
	seq uint64
	ev  flow.Event
}

// lostReason indexes the hub's lost counters.
type lostReason uint8

const (
	lostSlow lostReason = iota
	lostRate
	lostCapture
	numLostReasons
)

var lostReasonNames = [numLostReasons]string{LostSlow, LostRate, LostCapture}

// NewHub builds a hub with its ring. It starts nothing.
func NewHub(cfg HubConfig) *Hub {
	cfg = cfg.withDefaults()
	return &Hub{cfg: cfg, slots: make([]slot, cfg.RingSize), writeStall: defaultWriteStall, coalesce: defaultCoalesce}
}

// ForPort returns the Recorder of one service port: it sets each event's Port to p and writes it
// to the ring. It also implements flow.Capturer.
func (h *Hub) ForPort(p *flow.Port) flow.Recorder {
	return &portRecorder{hub: h, port: p}
}

type portRecorder struct {
	hub  *Hub
	port *flow.Port
}

var (
	_ flow.Recorder = (*portRecorder)(nil)
	_ flow.Capturer = (*portRecorder)(nil)
	_ flow.Observed = (*portRecorder)(nil)
)

// Observed reports whether an observer follows the stream now (one atomic load): the data path
// then adds the addresses that cost it a system call per flow.
func (r *portRecorder) Observed() bool { return r.hub.admitted.Load() > 0 }

// Record copies e into the ring. It takes no lock but the slot's and allocates nothing.
func (r *portRecorder) Record(e *flow.Event) {
	r.hub.write(e, r.port)
}

func (h *Hub) write(e *flow.Event, p *flow.Port) {
	h.put(h.head.Add(1)-1, e, p)
	if obs := h.observers.Load(); obs != nil {
		for _, o := range *obs {
			o.poke()
		}
	}
}

// put writes the event numbered seq to its slot.
func (h *Hub) put(seq uint64, e *flow.Event, p *flow.Port) {
	s := &h.slots[seq%uint64(len(h.slots))]
	s.mu.Lock()
	// A writer preempted between taking its number and writing may find the slot already
	// holding an event a whole ring newer: its own is older than anything the ring keeps, so it
	// is dropped rather than overwrite the newer one (which an observer may wait for).
	if s.seq <= seq {
		s.ev = *e
		s.ev.Port = p
		s.seq = seq + 1
	}
	s.mu.Unlock()
}

// readState is what read found in a slot.
type readState uint8

const (
	readOK      readState = iota
	readPending           // the event was numbered but its writer has not finished: wait
	readGone              // overwritten by a newer event: the reader was overtaken
	readSkipped           // there, but of a phase the reader does not want: not copied
)

// read copies the event numbered seq into e.
func (h *Hub) read(seq uint64, e *flow.Event, phases uint8) readState {
	s := &h.slots[seq%uint64(len(h.slots))]
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.seq == seq+1 && phases&(1<<s.ev.Phase) == 0:
		return readSkipped // a phase the reader does not want: not worth the copy
	case s.seq == seq+1:
		*e = s.ev
		return readOK
	case s.seq > seq+1:
		return readGone
	}
	return readPending
}

// oldest is the sequence number of the oldest event the ring may still hold, given head.
func (h *Hub) oldest(head uint64) uint64 {
	if n := uint64(len(h.slots)); head > n {
		return head - n
	}
	return 0
}

// admit takes an observer slot, false if MaxObservers are connected.
func (h *Hub) admit() bool {
	for {
		n := h.admitted.Load()
		if int(n) >= h.cfg.MaxObservers {
			return false
		}
		if h.admitted.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// subscribe makes o woken by new events until unsubscribe.
func (h *Hub) subscribe(o *observer) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var list []*observer
	if old := h.observers.Load(); old != nil {
		list = append(list, *old...)
	}
	list = append(list, o)
	h.observers.Store(&list)
	if o.capture {
		h.capturing.Add(1)
	}
}

// unsubscribe removes o and gives back its observer slot.
func (h *Hub) unsubscribe(o *observer) {
	h.mu.Lock()
	defer h.mu.Unlock()
	o.gone.Store(true)
	var list []*observer
	if old := h.observers.Load(); old != nil {
		for _, x := range *old {
			if x != o {
				list = append(list, x)
			}
		}
	}
	if len(list) == 0 {
		h.observers.Store(nil)
	} else {
		h.observers.Store(&list)
	}
	if o.capture {
		h.capturing.Add(-1)
	}
}

func (h *Hub) release() { h.admitted.Add(-1) }

// HubStats are the hub's counters, for metrics.
type HubStats struct {
	// Events counts the events recorded since the hub was built.
	Events uint64
	// Lost counts the events (and payload pieces) observers lost, by reason: LostSlow, LostRate,
	// LostCapture; every reason is present.
	Lost map[string]uint64
	// Observers is the number of /debug/flows requests served now; Captures how many of them
	// asked for payload.
	Observers, Captures int
	// Taps is the number of flows being captured now.
	Taps int
}

// Stats returns the hub's counters.
func (h *Hub) Stats() HubStats {
	s := HubStats{
		Events:    h.head.Load(),
		Lost:      make(map[string]uint64, numLostReasons),
		Observers: int(h.admitted.Load()),
		Captures:  int(h.capturing.Load()),
		Taps:      int(h.taps.Load()),
	}
	for i, n := range lostReasonNames {
		s.Lost[n] = h.lost[i].Load()
	}
	return s
}
