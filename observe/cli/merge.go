package cli

import (
	"container/heap"
	"time"
)

// merger orders the items of several streams by time while they are followed. Each stream is in
// time order (the proxy sends its ring in order), so an item can go out once every open stream
// has shown an item at least as late (its watermark). A quiet stream would hold the rest back
// forever: an item waits at most window after it arrived, then goes out anyway.
type merger struct {
	window time.Duration
	wm     []time.Time // the last item's time, per stream
	open   []bool
	queue  itemHeap
	seq    uint64
}

func newMerger(streams int, window time.Duration) *merger {
	m := &merger{window: window, wm: make([]time.Time, streams), open: make([]bool, streams)}
	for i := range m.open {
		m.open[i] = true
	}
	return m
}

// add queues an item that arrived at now.
func (m *merger) add(it item, now time.Time) {
	t := it.time()
	if t.After(m.wm[it.src]) {
		m.wm[it.src] = t
	}
	m.seq++
	heap.Push(&m.queue, queued{item: it, t: t, arrived: now, seq: m.seq})
}

// close says stream src ended: it holds nothing back any more.
func (m *merger) close(src int) { m.open[src] = false }

// ready pops the items that may go out at now, in time order, and says how long until the
// earliest of the rest must go anyway (0: nothing is queued).
func (m *merger) ready(now time.Time) (out []item, wait time.Duration) {
	for m.queue.Len() > 0 {
		q := m.queue[0]
		if !m.covered(q.t) && now.Sub(q.arrived) < m.window {
			return out, q.arrived.Add(m.window).Sub(now)
		}
		heap.Pop(&m.queue)
		out = append(out, q.item)
	}
	return out, 0
}

// covered says every open stream has reached t.
func (m *merger) covered(t time.Time) bool {
	for i, open := range m.open {
		if open && m.wm[i].Before(t) {
			return false
		}
	}
	return true
}

type queued struct {
	item
	t       time.Time
	arrived time.Time
	seq     uint64 // arrival order, for equal times
}

type itemHeap []queued

func (h itemHeap) Len() int { return len(h) }
func (h itemHeap) Less(i, j int) bool {
	if !h[i].t.Equal(h[j].t) {
		return h[i].t.Before(h[j].t)
	}
	return h[i].seq < h[j].seq
}
func (h itemHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *itemHeap) Push(x any)   { *h = append(*h, x.(queued)) }
func (h *itemHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
