package conntrack

import (
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// key names one conntrack entry: its id (unique among live entries, 0 on kernels that send none)
// and its original tuple, so an id the kernel reuses for another flow is not mistaken for it.
type key struct {
	id            uint32
	proto         flow.Protocol
	client, local netip.AddrPort
}

// started is what the watcher keeps of an entry's NEW until its DESTROY: when it started (for
// Duration when the kernel stamps no times) and the port's Recorder, so the End goes where the
// Start went even if the port was removed in between.
type started struct {
	id    uint64 // the flow's ID
	start time.Time
	rec   flow.Recorder
	seq   uint64 // which insertion of the key the ring slot belongs to
}

// slot is one insertion, in the ring that orders them.
type slot struct {
	k   key
	seq uint64
}

// pending holds the started entries of matching ports until their DESTROY, at most max of them:
// an entry whose DESTROY never comes (lost in an overrun, or the watcher stopped) would otherwise
// stay forever. When full, the oldest insertion goes, and is counted. The ring lists insertions
// in order; a slot whose entry already ended is skipped when it comes round. Every live entry
// has its slot, so the map never holds more than the ring. The ring grows by doubling up to max,
// so a node with few kernel-path flows never holds a 65,536-slot ring. One goroutine owns it.
type pending struct {
	max     int
	m       map[key]started
	ring    []slot
	head, n int
	seq     uint64
	evicted uint64
}

func newPending(max int) *pending {
	return &pending{max: max, m: make(map[key]started)}
}

// add records a started entry, dropping the oldest one when max are held.
func (p *pending) add(k key, s started) {
	// Slots of entries already ended leave from the head first, so a node whose flows end in
	// about the order they start keeps a small ring.
	for p.n > 0 && p.stale(p.ring[p.head]) {
		p.head = (p.head + 1) % len(p.ring)
		p.n--
	}
	if p.n == len(p.ring) {
		p.grow()
	}
	if p.n == len(p.ring) { // full at max: the oldest insertion leaves
		old := p.ring[p.head]
		p.head = (p.head + 1) % len(p.ring)
		p.n--
		if v, ok := p.m[old.k]; ok && v.seq == old.seq {
			delete(p.m, old.k)
			p.evicted++
		}
	}
	p.seq++
	s.seq = p.seq
	p.m[k] = s
	p.ring[(p.head+p.n)%len(p.ring)] = slot{k: k, seq: s.seq}
	p.n++
}

func (p *pending) stale(sl slot) bool {
	v, ok := p.m[sl.k]
	return !ok || v.seq != sl.seq
}

// grow doubles the ring, up to max.
func (p *pending) grow() {
	size := min(max(2*len(p.ring), 64), p.max)
	if size <= len(p.ring) {
		return
	}
	ring := make([]slot, size)
	for i := range p.n {
		ring[i] = p.ring[(p.head+i)%len(p.ring)]
	}
	p.ring, p.head = ring, 0
}

// take removes and returns an entry's start. Its ring slot stays until it comes round.
func (p *pending) take(k key) (started, bool) {
	s, ok := p.m[k]
	if ok {
		delete(p.m, k)
	}
	return s, ok
}

func (p *pending) len() int { return len(p.m) }
