package tcp

import (
	"sync/atomic"
	"testing"
	"time"
)

// testTrimmer counts releases instead of returning memory; every is an hour.
func testTrimmer(after int, quiet, maxDelay time.Duration) (*trimmer, *atomic.Int32) {
	released := new(atomic.Int32)
	return &trimmer{
		release: func() { released.Add(1) },
		after:   after, quiet: quiet, maxDelay: maxDelay, every: time.Hour,
	}, released
}

func TestTrimmerReleasesAfterAWaveOfParking(t *testing.T) {
	tr, released := testTrimmer(10, 20*time.Millisecond, time.Second)
	for range 9 {
		tr.parked()
	}
	// Below the threshold nothing is scheduled at all.
	tr.mu.Lock()
	pending := tr.timer != nil
	tr.mu.Unlock()
	if pending {
		t.Fatal("a trim was scheduled after 9 parks, want none before 10")
	}
	tr.parked()
	waitFor(t, "the trim after the wave", func() bool { return released.Load() == 1 })

	// A second wave within `every` is held back: no release while the interval lasts.
	for range 10 {
		tr.parked()
	}
	tr.mu.Lock()
	armed := !tr.armedAt.IsZero()
	tr.mu.Unlock()
	if !armed {
		t.Fatal("the second wave did not schedule a trim")
	}
	deadline := time.Now().Add(100 * time.Millisecond)
	for time.Now().Before(deadline) {
		if n := released.Load(); n != 1 {
			t.Fatalf("%d releases within the rate limit, want 1", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestTrimmerWaitsForTheWaveToEnd(t *testing.T) {
	tr, released := testTrimmer(1, 50*time.Millisecond, time.Hour)
	// Parking every 10 ms keeps postponing the trim (quiet is 50 ms).
	for range 20 {
		tr.parked()
		time.Sleep(10 * time.Millisecond)
		if released.Load() != 0 {
			t.Fatal("released while directions were still parking")
		}
	}
	waitFor(t, "the trim once parking paused", func() bool { return released.Load() == 1 })
}

func TestTrimmerMaxDelay(t *testing.T) {
	tr, released := testTrimmer(1, 50*time.Millisecond, 30*time.Millisecond)
	// Parking never pauses, but after maxDelay the timer is no longer pushed back.
	stop := time.Now().Add(10 * time.Second)
	for released.Load() == 0 {
		if time.Now().After(stop) {
			t.Fatal("no trim while parking went on past maxDelay")
		}
		tr.parked()
		time.Sleep(5 * time.Millisecond)
	}
}
