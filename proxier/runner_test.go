package proxier

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

// runnerHarness runs a boundedRunner on a fake clock and records when fn ran.
type runnerHarness struct {
	clk  *clocktesting.FakeClock
	r    *boundedRunner
	mu   sync.Mutex
	runs []time.Time
	fail int // fail this many runs
	ran  chan struct{}
}

func newRunnerHarness(t *testing.T, minI, maxI time.Duration) *runnerHarness {
	h := &runnerHarness{clk: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), ran: make(chan struct{}, 100)}
	h.r = newBoundedRunner(func(context.Context) error {
		h.mu.Lock()
		h.runs = append(h.runs, h.clk.Now())
		fail := h.fail > 0
		if fail {
			h.fail--
		}
		h.mu.Unlock()
		h.ran <- struct{}{}
		if fail {
			return errors.New("injected failure")
		}
		return nil
	}, minI, maxI, h.clk)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.r.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return h
}

// waitRun waits (with a deadline) for the next run of fn.
func (h *runnerHarness) waitRun(t *testing.T) {
	t.Helper()
	select {
	case <-h.ran:
	case <-time.After(5 * time.Second):
		t.Fatal("runner did not run within 5s")
	}
}

// noRun asserts fn does not run once the runner is parked on its timer.
func (h *runnerHarness) noRun(t *testing.T) {
	t.Helper()
	h.waitParked(t)
	select {
	case <-h.ran:
		t.Fatal("runner ran when it should not have")
	default:
	}
}

// waitParked waits until the runner goroutine is blocked on a clock timer.
func (h *runnerHarness) waitParked(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !h.clk.HasWaiters() {
		if time.Now().After(deadline) {
			t.Fatal("runner never waited on the clock")
		}
		time.Sleep(time.Millisecond) // polling a condition, not synchronising on time
	}
}

func TestBoundedRunner(t *testing.T) {
	t.Run("first_trigger_runs_at_once", func(t *testing.T) {
		h := newRunnerHarness(t, time.Second, 30*time.Second)
		h.waitParked(t)
		h.r.Trigger()
		h.waitRun(t)
	})
	t.Run("triggers_within_min_interval_coalesce", func(t *testing.T) {
		h := newRunnerHarness(t, time.Second, 30*time.Second)
		h.waitParked(t)
		h.r.Trigger()
		h.waitRun(t)
		h.r.Trigger()
		h.r.Trigger()
		h.noRun(t)
		h.clk.Step(500 * time.Millisecond)
		h.noRun(t)
		h.clk.Step(500 * time.Millisecond)
		h.waitRun(t)
		h.noRun(t)
	})
	t.Run("runs_every_max_interval_untriggered", func(t *testing.T) {
		h := newRunnerHarness(t, time.Second, 30*time.Second)
		h.noRun(t)
		h.clk.Step(29 * time.Second)
		h.noRun(t)
		h.clk.Step(time.Second)
		h.waitRun(t)
		h.noRun(t)
		h.clk.Step(30 * time.Second)
		h.waitRun(t)
	})
	t.Run("failure_is_retried", func(t *testing.T) {
		h := newRunnerHarness(t, time.Second, 30*time.Second)
		h.fail = 1
		h.waitParked(t)
		h.r.Trigger()
		h.waitRun(t)
		h.noRun(t)
		h.clk.Step(time.Second)
		h.waitRun(t)
		h.mu.Lock()
		defer h.mu.Unlock()
		if got := h.runs[1].Sub(h.runs[0]); got != time.Second {
			t.Errorf("retry came %v after the failure, want 1s", got)
		}
	})
}
