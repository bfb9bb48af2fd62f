package tcp

import (
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"
)

// When a burst of connections goes idle, their directions park and the goroutine stacks they ran
// on become free, but the Go runtime keeps free memory resident: stack spans go back to the heap
// only at the next GC (an idle proxy may not run one for two minutes), and the scavenger returns
// free heap pages to the OS at its own slow pace. Measured with bench/suite (9,000 connections
// opened in a burst, RSS read 3 s later): 4.2-4.6 KiB per idle connection without this trimmer,
// 3.0-3.1 KiB with it (HAProxy 3.2-3.3 KiB). So after a wave of parking the proxy returns free memory to
// the OS itself: debug.FreeOSMemory, a GC plus a full scavenge, a few milliseconds of CPU for the
// heap of 10,000 idle connections, and rate-limited.
//
// One trimmer serves the whole process, since memory is process-wide.
var stackTrim = &trimmer{
	release:  debug.FreeOSMemory,
	after:    1000,                   // parks that make a wave worth trimming: ~4 MiB of stacks
	quiet:    200 * time.Millisecond, // the wave has ended when no direction parked for this long
	maxDelay: 2 * time.Second,        // ... or when it has gone on this long
	every:    10 * time.Second,       // at most one trim per interval
	clock:    clock.RealClock{},
}

// trimmer calls release once at least after parks have been counted and parking then paused for
// quiet (or went on for maxDelay), but not more often than every. The release runs on its own
// goroutine, started by a timer; it is bounded and needs no stopping.
type trimmer struct {
	release                func()
	after                  int
	quiet, maxDelay, every time.Duration
	clock                  clock.WithDelayedExecution

	parks atomic.Int64 // counted without the lock: every park of every proxy counts

	mu      sync.Mutex
	timer   clock.Timer
	armedAt time.Time // when the pending trim was first scheduled; zero if none is pending
	last    time.Time // the last release
}

// parked counts one direction that parked.
func (t *trimmer) parked() {
	if t.parks.Add(1) < int64(t.after) {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.clock.Now()
	switch {
	case t.armedAt.IsZero():
		t.armedAt = now
		if t.timer == nil {
			// A goroutine of its own: a fake clock runs the callback while it holds its lock, and
			// fire uses the clock.
			t.timer = t.clock.AfterFunc(t.quiet, func() { go t.fire() })
		} else {
			t.timer.Reset(t.quiet)
		}
	case now.Sub(t.armedAt) < t.maxDelay:
		t.timer.Reset(t.quiet) // still parking: wait for the wave to end
	}
}

func (t *trimmer) fire() {
	t.mu.Lock()
	// A fake clock's timer also delivers on C, with room for one value; drain it so the timer can
	// fire again after a Reset. (A real AfterFunc timer has no channel: nothing to drain.)
	select {
	case <-t.timer.C():
	default:
	}
	if t.armedAt.IsZero() { // a Reset raced with the previous fire, which did the work
		t.mu.Unlock()
		return
	}
	if wait := t.every - t.clock.Since(t.last); !t.last.IsZero() && wait > 0 {
		t.timer.Reset(wait)
		t.mu.Unlock()
		return
	}
	t.parks.Store(0)
	t.armedAt, t.last = time.Time{}, t.clock.Now()
	t.mu.Unlock()
	t.release()
}
