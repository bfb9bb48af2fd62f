package loadbalancer

import (
	"sync/atomic"
	"time"
)

// minWarmWeight is a warming endpoint's weight at the start of its window (Envoy's
// min_weight_percent default): at zero a pod that just became ready would get nothing at all
// until some time has passed, and a service with only new endpoints would stall on the rounds
// they decline.
const minWarmWeight = 0.1

// warmWeight is e's weight at now in a slow-start window: rising linearly from minWarmWeight
// when it joined (or came back from an ejection) to 1 at the window's end.
func warmWeight(e *endpoint, now, window int64) float64 {
	elapsed := now - e.warmFrom.Load()
	if elapsed >= window {
		return 1
	}
	return max(float64(elapsed)/float64(window), minWarmWeight)
}

// warmFrom starts e's slow-start window at t (unix nanoseconds), if slow start is on.
func (s *Service) warmFrom(e *endpoint, t int64) {
	e.warmFrom.Store(t)
	if w := s.slowStart.Load(); w > 0 {
		raise(&s.warmHint, t+w)
	}
}

// raise sets v to at least x.
func raise(v *atomic.Int64, x int64) {
	for old := v.Load(); old < x && !v.CompareAndSwap(old, x); old = v.Load() {
	}
}

func (s *Service) setSlowStart(d time.Duration) {
	if d <= 0 {
		s.slowStart.Store(0)
		s.warmHint.Store(0)
		return
	}
	s.slowStart.Store(int64(d))
}
