package testenv

import (
	"io"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"sync/atomic"
)

// LiveHeap is the heap still reachable after a full collection.
func LiveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// HeapPeak records the most live heap seen: at every collection while it runs (the runtime's own
// count of what the collection marked, read when the collection's finalizers run) and at every
// Note. GOGC is 2 meanwhile, so collections are frequent and the peak of what runs is caught
// wherever it is, not only where a note is taken.
type HeapPeak struct {
	mu   sync.Mutex
	peak uint64
	stop atomic.Bool
	gogc int
}

// sentinel is the object whose finalizer runs once per collection; a pointer field keeps it out
// of the tiny allocator, whose blocks are freed (and finalized) only when all their objects are.
type sentinel struct{ _ *byte }

// StartHeapPeak sets GOGC to 2 and starts recording; End restores it.
func StartHeapPeak() *HeapPeak {
	h := &HeapPeak{gogc: debug.SetGCPercent(2)}
	h.arm()
	return h
}

func (h *HeapPeak) arm() {
	runtime.SetFinalizer(&sentinel{}, func(*sentinel) {
		s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
		metrics.Read(s)
		h.record(s[0].Value.Uint64())
		if !h.stop.Load() {
			h.arm()
		}
	})
}

func (h *HeapPeak) record(v uint64) {
	h.mu.Lock()
	h.peak = max(h.peak, v)
	h.mu.Unlock()
}

// Note records the live heap now.
func (h *HeapPeak) Note() { h.record(LiveHeap()) }

// End stops the recording, restores GOGC and returns the peak.
func (h *HeapPeak) End() uint64 {
	h.stop.Store(true)
	debug.SetGCPercent(h.gogc)
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.peak
}

// ReadNoting reads input as a command reading a stream does (iptables-restore reading its input
// from a pipe), noting the live heap once the first chunk is in, while what writes the stream
// is alive, then reads the rest.
func (h *HeapPeak) ReadNoting(input io.Reader) error {
	_, err := io.ReadFull(input, make([]byte, 32<<10))
	h.Note()
	if err == io.ErrUnexpectedEOF || err == io.EOF {
		return nil
	}
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, input)
	return err
}
