package conntrack

import (
	"container/heap"
	"errors"
	"time"

	ct "github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Why probe: the kernel sends an entry's DESTROY when it removes the entry, not when the entry
// expires. An expired entry is removed by the conntrack garbage collector, whose pass adapts to
// the whole table's timeouts and comes up to a minute apart on a quiet node (GC_SCAN_INTERVAL_MAX
// in nf_conntrack_core.c), or by a lookup that walks past it. A kernel-path connection closed
// with a 1 s TIME_WAIT thus reached the flow stream's end 1 to 61 s after it closed. The watcher
// asks the kernel for each started entry of its ports (a GET, which is such a lookup): an entry
// found expired is removed by the GET itself, and its DESTROY follows at once; one still live
// tells its state and seconds left, and is asked again when those run out.

// entryGetter looks one conntrack entry up by its original tuple (ct.Conn does).
type entryGetter interface {
	Get(f ct.Flow) (ct.Flow, error)
}

// probeSchedule is when each started entry is next asked for: a heap by due time, with each
// entry's place kept so an End or an eviction takes it out at once. Run's goroutine owns it.
type probeSchedule struct {
	h  probeHeap
	at map[key]*probe
}

type probe struct {
	k   key
	due time.Time
	i   int // index in the heap
}

type probeHeap []*probe

func (h probeHeap) Len() int           { return len(h) }
func (h probeHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h probeHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].i, h[j].i = i, j
}
func (h *probeHeap) Push(x any) {
	p := x.(*probe)
	p.i = len(*h)
	*h = append(*h, p)
}
func (h *probeHeap) Pop() any {
	old := *h
	p := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return p
}

func newProbeSchedule() *probeSchedule {
	return &probeSchedule{at: make(map[key]*probe)}
}

// set schedules k's next probe at due, in place of any earlier one.
func (s *probeSchedule) set(k key, due time.Time) {
	if p, ok := s.at[k]; ok {
		p.due = due
		heap.Fix(&s.h, p.i)
		return
	}
	p := &probe{k: k, due: due}
	heap.Push(&s.h, p)
	s.at[k] = p
}

// drop forgets k's probe, if any.
func (s *probeSchedule) drop(k key) {
	if p, ok := s.at[k]; ok {
		heap.Remove(&s.h, p.i)
		delete(s.at, k)
	}
}

// next is the earliest due time; ok is false when nothing is scheduled.
func (s *probeSchedule) next() (time.Time, bool) {
	if len(s.h) == 0 {
		return time.Time{}, false
	}
	return s.h[0].due, true
}

// pop removes and returns the earliest probe if it is due at now.
func (s *probeSchedule) pop(now time.Time) (key, bool) {
	if len(s.h) == 0 || s.h[0].due.After(now) {
		return key{}, false
	}
	p := heap.Pop(&s.h).(*probe)
	delete(s.at, p.k)
	return p.k, true
}

func (s *probeSchedule) len() int { return len(s.h) }

// lookupFlow is the GET request for k: its original tuple.
func lookupFlow(k key) ct.Flow {
	proto := uint8(unix.IPPROTO_TCP)
	if k.proto == flow.UDP {
		proto = unix.IPPROTO_UDP
	}
	return ct.NewFlow(proto, 0, k.client.Addr(), k.local.Addr(), k.client.Port(), k.local.Port(), 0, 0)
}

// errNoEntry is what a GET of a missing entry returns (the kernel's ENOENT).
func errNoEntry(err error) bool { return errors.Is(err, unix.ENOENT) }

// afterProbe says when to ask again for an entry a GET found: just after the seconds it has
// left (the kernel rounds them down) for one that only a packet could keep alive, a TCP
// connection closing or a UDP session (a packet would refresh it, and the next GET says so);
// for an established TCP connection, whose seconds left are days, every recheck.
func afterProbe(f *ct.Flow, now time.Time, recheck time.Duration) time.Time {
	left := time.Duration(f.Timeout)*time.Second + time.Second
	if tcp := f.ProtoInfo.TCP; tcp != nil && tcp.State == tcpEstablished {
		left = min(left, recheck)
	}
	return now.Add(left)
}
