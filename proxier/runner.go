package proxier

import (
	"context"
	"time"

	"k8s.io/utils/clock"
)

// boundedRunner runs one function when asked, but never more often than minInterval, and at least
// every maxInterval even when nobody asks (the periodic resync that repairs what others changed).
// A failed run is retried after retryInterval. It is kube-proxy's BoundedFrequencyRunner, cut to
// what the proxier needs, with an injected clock so tests do not sleep.
type boundedRunner struct {
	fn            func(context.Context) error
	minInterval   time.Duration
	maxInterval   time.Duration
	retryInterval time.Duration
	clock         clock.Clock
	trigger       chan struct{}
}

func newBoundedRunner(fn func(context.Context) error, minInterval, maxInterval time.Duration, c clock.Clock) *boundedRunner {
	retry := minInterval
	if retry < time.Second {
		retry = time.Second
	}
	return &boundedRunner{fn: fn, minInterval: minInterval, maxInterval: maxInterval, retryInterval: retry, clock: c,
		trigger: make(chan struct{}, 1)}
}

// Trigger asks for a run; requests made while one is pending are coalesced. It never blocks.
func (r *boundedRunner) Trigger() {
	select {
	case r.trigger <- struct{}{}:
	default:
	}
}

// Run loops until ctx is done.
func (r *boundedRunner) Run(ctx context.Context) {
	var last, retryAt time.Time
	pending := false
	for {
		now := r.clock.Now()
		due := now.Add(r.maxInterval)
		if !last.IsZero() {
			due = last.Add(r.maxInterval)
		}
		if pending {
			if t := last.Add(r.minInterval); t.Before(due) {
				due = t
			}
		}
		if !retryAt.IsZero() && retryAt.Before(due) {
			due = retryAt
		}
		if wait := due.Sub(now); wait > 0 {
			timer := r.clock.NewTimer(wait)
			select {
			case <-ctx.Done():
				timer.Stop()
				return
			case <-r.trigger:
				timer.Stop()
				pending = true
				continue
			case <-timer.C():
			}
		} else if ctx.Err() != nil {
			return
		}
		pending = false
		last = r.clock.Now()
		retryAt = time.Time{}
		if err := r.fn(ctx); err != nil {
			retryAt = last.Add(r.retryInterval)
		}
	}
}
