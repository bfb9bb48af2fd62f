package tcp

import (
	"sync/atomic"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// testTrimmer counts releases instead of returning memory; every is an hour. It runs on a fake
// clock: the tests step it, so no test waits for real time to pass. A timer that fires starts the
// release on a goroutine; the tests poll for its effect, or see from the clock's pending timers
// that a timer did not fire.
func testTrimmer(after int, quiet, maxDelay time.Duration) (*trimmer, *atomic.Int32, *clocktesting.FakeClock) {
	released := new(atomic.Int32)
	clk := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	return &trimmer{
		release: func() { released.Add(1) },
		after:   after, quiet: quiet, maxDelay: maxDelay, every: time.Hour, clock: clk,
	}, released, clk
}

func TestTrimmerReleasesAfterAWaveOfParking(t *testing.T) {
	tr, released, clk := testTrimmer(10, 20*time.Millisecond, time.Second)
	for range 9 {
		tr.parked()
	}
	// Below the threshold nothing is scheduled at all.
	if clk.HasWaiters() {
		t.Fatal("a trim was scheduled after 9 parks, want none before 10")
	}
	tr.parked()
	clk.Step(19 * time.Millisecond)
	if !clk.HasWaiters() {
		t.Fatal("the trim fired before the wave had been quiet for 20ms")
	}
	clk.Step(time.Millisecond)
	testenv.WaitFor(t, "the trim after the wave", func() bool { return released.Load() == 1 })

	// A second wave within `every` is held back: when its timer fires, the trim is put off to the
	// end of the interval (a pending timer again) instead of releasing.
	for range 10 {
		tr.parked()
	}
	tr.mu.Lock()
	armed := !tr.armedAt.IsZero()
	tr.mu.Unlock()
	if !armed {
		t.Fatal("the second wave did not schedule a trim")
	}
	clk.Step(20 * time.Millisecond)
	testenv.WaitFor(t, "the held-back trim to be rescheduled", clk.HasWaiters)
	if n := released.Load(); n != 1 {
		t.Fatalf("%d releases within the rate limit, want 1", n)
	}
	clk.Step(time.Hour)
	testenv.WaitFor(t, "the held-back trim once the interval passed", func() bool { return released.Load() == 2 })
}

func TestTrimmerWaitsForTheWaveToEnd(t *testing.T) {
	tr, released, clk := testTrimmer(1, 50*time.Millisecond, time.Hour)
	// Parking every 10 ms keeps postponing the trim (quiet is 50 ms): its timer stays pending.
	for range 20 {
		tr.parked()
		clk.Step(10 * time.Millisecond)
		if !clk.HasWaiters() || released.Load() != 0 {
			t.Fatal("the trim fired while directions were still parking")
		}
	}
	clk.Step(40 * time.Millisecond)
	testenv.WaitFor(t, "the trim once parking paused", func() bool { return released.Load() == 1 })
}

func TestTrimmerMaxDelay(t *testing.T) {
	tr, released, clk := testTrimmer(1, 50*time.Millisecond, 30*time.Millisecond)
	// Parking never pauses for quiet, but after maxDelay (30 ms) the timer is no longer pushed
	// back: the park at 25 ms set it for 75 ms. (Without maxDelay, the park at 70 ms would have
	// pushed it to 120 ms.)
	for range 15 { // parks at 0, 5, ..., 70 ms
		tr.parked()
		clk.Step(5 * time.Millisecond)
	}
	testenv.WaitFor(t, "a trim while parking went on past maxDelay", func() bool { return released.Load() == 1 })
}
