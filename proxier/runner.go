package proxier

import (
	"context"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"
)

// remindEvery is how often a sync that keeps failing with the same error is logged again.
const remindEvery = 10 * time.Minute

// boundedRunner runs one function when asked, but never more often than minInterval, and at least
// every maxInterval even when nobody asks (the periodic resync that repairs what others changed).
// A failed run is retried after retryInterval. It is kube-proxy's BoundedFrequencyRunner, cut to
// what the proxier needs, with an injected clock so tests do not sleep.
//
// The runner is where a failed run is logged, once: when the failures start, when the error
// changes, every remindEvery while the same error lasts, and when a run succeeds again. The
// retries in between log at debug level only, so a broken iptables does not flood the log.
type boundedRunner struct {
	fn            func(context.Context) error
	minInterval   time.Duration
	maxInterval   time.Duration
	retryInterval time.Duration
	clock         clock.Clock
	log           logrus.FieldLogger
	trigger       chan struct{}

	// Owned by Run: the failure being reported.
	failures     int // consecutive failed runs
	failingSince time.Time
	lastErr      string
	lastLogged   time.Time
}

func newBoundedRunner(fn func(context.Context) error, minInterval, maxInterval time.Duration, c clock.Clock, log logrus.FieldLogger) *boundedRunner {
	retry := minInterval
	if retry < time.Second {
		retry = time.Second
	}
	return &boundedRunner{fn: fn, minInterval: minInterval, maxInterval: maxInterval, retryInterval: retry, clock: c,
		log: log, trigger: make(chan struct{}, 1)}
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
		err := r.fn(ctx)
		if ctx.Err() != nil {
			return // a run cut short by the shutdown is no failure worth reporting
		}
		r.report(err, last)
		if err != nil {
			retryAt = last.Add(r.retryInterval)
		}
	}
}

// report logs the outcome of a run that started at now, as the type's comment describes.
func (r *boundedRunner) report(err error, now time.Time) {
	if err == nil {
		if r.failures > 0 {
			r.log.WithFields(logrus.Fields{"failures": r.failures, "failingFor": now.Sub(r.failingSince).String()}).
				Info("Sync recovered")
		}
		r.failures, r.lastErr = 0, ""
		return
	}
	r.failures++
	if r.failures == 1 {
		r.failingSince = now
	}
	l := r.log.WithError(err).WithFields(logrus.Fields{"failures": r.failures, "retryIn": r.retryInterval.String()})
	switch msg := err.Error(); {
	case r.failures == 1:
		l.Error("Sync failed")
	case msg != r.lastErr:
		l.Error("Sync failed with a new error")
	case now.Sub(r.lastLogged) >= remindEvery:
		l.WithField("failingFor", now.Sub(r.failingSince).String()).Error("Sync still failing")
	default:
		l.Debug("Sync failed again")
		return
	}
	r.lastErr, r.lastLogged = err.Error(), now
}
