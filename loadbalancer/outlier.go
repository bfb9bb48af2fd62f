package loadbalancer

import (
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// maxEjectionCap bounds the growing ejection time (unless ejection-time alone is longer):
// Envoy's default max_ejection_time.
const maxEjectionCap = 5 * time.Minute

// Ejection is one endpoint taken out of rotation by outlier detection, for the log and events.
type Ejection struct {
	Service  service.ServicePortName
	Endpoint netip.AddrPort
	// Failures is the streak that ejected it; Reset says it was of immediate resets, not of
	// failed dials.
	Failures int
	Reset    bool
	// Ejections counts this endpoint's ejections in a row (the back-off multiplier), Duration is
	// how long it stays out.
	Ejections int
	Duration  time.Duration
}

// OnEjection sets the function told about every ejection (a log line and a Warning event). It
// runs on the goroutine that reported the failure, without balancer locks held.
func (lb *LoadBalancer) OnEjection(f func(Ejection)) { lb.hook.Store(&f) }

// ejectedAt reports whether e is out of rotation at now (unix nanoseconds).
func ejectedAt(e *endpoint, now int64) bool { return now < e.ejectedUntil.Load() }

// failed counts a failure of e: a failed dial, or (reset) a connection the endpoint reset at once.
func (s *Service) failed(e *endpoint, reset bool) {
	o := s.outlier.Load()
	if o == nil {
		return
	}
	streak := &e.dialFails
	if reset {
		streak = &e.resetFails
	}
	if n := streak.Add(1); int(n) >= o.ConsecutiveFailures {
		s.eject(e, o, int(n), reset)
	}
}

// succeeded ends e's streak of failed dials, and forgets its past ejections once it has stayed in
// rotation for an ejection time since it came back.
func (s *Service) succeeded(e *endpoint) {
	if e.dialFails.Load() != 0 {
		e.dialFails.Store(0)
	}
	if e.ejections.Load() == 0 {
		return
	}
	o := s.outlier.Load()
	if o == nil {
		e.ejections.Store(0)
		return
	}
	if s.clock.Now().UnixNano() >= e.ejectedUntil.Load()+int64(o.EjectionTime) {
		e.ejections.Store(0)
	}
}

// eject takes e out of rotation unless it is out already, gone, or the service port has as many
// endpoints out as MaxEjectionPercent allows (the streak then stands, and its next failure tries
// again). Ejections are rare, so they are serialised, which keeps the limit exact.
func (s *Service) eject(e *endpoint, o *service.Outlier, failures int, reset bool) {
	s.ejectMu.Lock()
	now := s.clock.Now().UnixNano()
	set := s.eps.Load()
	if ejectedAt(e, now) || set.get(e.addr) != e || s.outlier.Load() != o {
		s.ejectMu.Unlock()
		return
	}
	out := 0
	for _, x := range set.eps {
		if ejectedAt(x, now) {
			out++
		}
	}
	if out+1 > maxEjectable(len(set.eps), o.MaxEjectionPercent) {
		s.ejectMu.Unlock()
		return
	}
	n := int(e.ejections.Add(1))
	d := min(o.EjectionTime*time.Duration(n), max(maxEjectionCap, o.EjectionTime))
	until := now + int64(d)
	e.ejectedUntil.Store(until)
	s.warmFrom(e, until) // when it returns, it warms up again
	e.dialFails.Store(0)
	e.resetFails.Store(0)
	raise(&s.ejectHint, until)
	s.ejectionsTotal.Add(1)
	s.ejectMu.Unlock()
	if f := s.hook.Load(); f != nil {
		(*f)(Ejection{Service: s.name, Endpoint: e.addr, Failures: failures, Reset: reset, Ejections: n, Duration: d})
	}
}

// maxEjectable is how many of n endpoints may be out at once: pct percent, rounded down, but at
// least one of two or more (a lone endpoint is never ejected: there would be nothing left).
func maxEjectable(n, pct int) int {
	m := n * pct / 100
	if m == 0 && n >= 2 && pct > 0 {
		m = 1
	}
	return m
}

func (s *Service) setOutlier(o service.Outlier) {
	if !o.On() {
		if s.outlier.Swap(nil) != nil {
			s.ejectHint.Store(0)
			for _, e := range s.eps.Load().eps { // back into rotation, streaks forgotten
				e.ejectedUntil.Store(0)
				e.ejections.Store(0)
				e.dialFails.Store(0)
				e.resetFails.Store(0)
			}
		}
		return
	}
	if o.EjectionTime <= 0 {
		o.EjectionTime = service.DefaultEjectionTime
	}
	if o.MaxEjectionPercent <= 0 {
		o.MaxEjectionPercent = service.DefaultMaxEjectionPercent
	}
	if cur := s.outlier.Load(); cur == nil || *cur != o {
		s.outlier.Store(&o)
	}
}

// Outliers reports the ejections so far and the endpoints out of rotation now (metrics).
func (s *Service) Outliers() (ejectionsTotal uint64, ejected int) {
	now := s.clock.Now().UnixNano()
	for _, e := range s.eps.Load().eps {
		if ejectedAt(e, now) {
			ejected++
		}
	}
	return s.ejectionsTotal.Load(), ejected
}
