package proxier

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// runnerHarness runs a boundedRunner on a fake clock and records when fn ran.
type runnerHarness struct {
	clk  *clocktesting.FakeClock
	r    *boundedRunner
	mu   sync.Mutex
	runs []time.Time
	fail int   // fail this many runs
	err  error // what a failing run returns; "injected failure" when nil
	ran  chan struct{}
	log  *logtest.Hook
}

func newRunnerHarness(t *testing.T, minI, maxI time.Duration) *runnerHarness {
	h := &runnerHarness{clk: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), ran: make(chan struct{}, 100)}
	log, hook := logtest.NewNullLogger()
	log.SetLevel(logrus.DebugLevel)
	h.log = hook
	h.r = newBoundedRunner(func(context.Context) error {
		h.mu.Lock()
		h.runs = append(h.runs, h.clk.Now())
		fail := h.fail > 0
		if fail {
			h.fail--
		}
		err := h.err
		h.mu.Unlock()
		h.ran <- struct{}{}
		if !fail {
			return nil
		}
		if err == nil {
			err = errors.New("injected failure")
		}
		return err
	}, minI, maxI, h.clk, log)
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
	testenv.WaitFor(t, "the runner to wait on the clock", h.clk.HasWaiters)
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

// logLines renders the runner's log: level, message and the fields that say what failed.
func (h *runnerHarness) logLines() []string {
	var out []string
	for _, e := range h.log.AllEntries() {
		l := e.Level.String() + ": " + e.Message
		for _, k := range []string{"failures", "failingFor", "error"} {
			if v, ok := e.Data[k]; ok {
				l += fmt.Sprintf(" %s=%v", k, v)
			}
		}
		out = append(out, l)
	}
	return out
}

// runAndPark steps the clock, waits for the run and for the runner to park again (so the run has
// been reported).
func (h *runnerHarness) runAndPark(t *testing.T, step time.Duration) {
	t.Helper()
	h.clk.Step(step)
	h.waitRun(t)
	h.waitParked(t)
}

// TestBoundedRunnerLogsFailuresOnce checks that a failing sync is logged with its error when
// the failures start, when the error changes and when they stop, not on every retry.
func TestBoundedRunnerLogsFailuresOnce(t *testing.T) {
	restoreFailed := errors.New("sync portals of 1 service ports (changed since the last good sync: ns/web:http): portal IPv4 nat: restore: iptables-restore: exit status 1: line 3 failed")
	t.Run("start_change_and_recovery", func(t *testing.T) {
		h := newRunnerHarness(t, time.Second, 30*time.Second)
		h.mu.Lock()
		h.fail, h.err = 3, restoreFailed
		h.mu.Unlock()
		h.waitParked(t)
		h.r.Trigger()
		h.waitRun(t)
		h.waitParked(t)
		h.runAndPark(t, time.Second) // the same error again
		h.mu.Lock()
		h.err = errors.New("portal IPv4 filter: read back: iptables-save: exit status 4: another app holds the xtables lock")
		h.mu.Unlock()
		h.runAndPark(t, time.Second)
		h.runAndPark(t, time.Second) // works
		h.runAndPark(t, 30*time.Second)
		want := []string{
			"error: Sync failed failures=1 error=" + restoreFailed.Error(),
			"debug: Sync failed again failures=2 error=" + restoreFailed.Error(),
			"error: Sync failed with a new error failures=3 error=portal IPv4 filter: read back: iptables-save: exit status 4: another app holds the xtables lock",
			"info: Sync recovered failures=3 failingFor=3s",
		}
		if diff := cmp.Diff(want, h.logLines()); diff != "" {
			t.Errorf("log (-want +got):\n%s", diff)
		}
	})
	t.Run("lasting_failure_is_recalled_every_ten_minutes", func(t *testing.T) {
		h := newRunnerHarness(t, time.Minute, time.Hour) // retries every minute
		h.mu.Lock()
		h.fail = 12
		h.mu.Unlock()
		h.waitParked(t)
		h.r.Trigger()
		h.waitRun(t)
		h.waitParked(t)
		for range 11 {
			h.runAndPark(t, time.Minute)
		}
		var errs []string
		debug := 0
		for _, l := range h.logLines() {
			if strings.HasPrefix(l, "debug: ") {
				debug++
			} else {
				errs = append(errs, l)
			}
		}
		want := []string{
			"error: Sync failed failures=1 error=injected failure",
			"error: Sync still failing failures=11 failingFor=10m0s error=injected failure",
		}
		if diff := cmp.Diff(want, errs); diff != "" {
			t.Errorf("log above debug (-want +got):\n%s", diff)
		}
		if debug != 10 {
			t.Errorf("%d debug lines, want 10 (one per quiet retry)", debug)
		}
	})
	t.Run("shutdown_is_not_a_failure", func(t *testing.T) {
		clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
		log, hook := logtest.NewNullLogger()
		ctx, cancel := context.WithCancel(context.Background())
		r := newBoundedRunner(func(ctx context.Context) error { cancel(); return ctx.Err() }, time.Second, time.Minute, clk, log)
		r.Trigger()
		r.Run(ctx)
		if n := len(hook.AllEntries()); n != 0 {
			t.Errorf("a run cut short by the shutdown logged %d lines", n)
		}
	})
}
