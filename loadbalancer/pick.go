package loadbalancer

import (
	"math/rand/v2"
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The algorithms as stored in Service.algo (an atomic, so a pick reads it without a lock).
const (
	algoRoundRobin uint32 = iota
	algoLeastConnections
	algoRandomTwoChoices
)

func algoCode(a service.Algorithm) uint32 {
	switch a {
	case service.LeastConnections:
		return algoLeastConnections
	case service.RandomTwoChoices:
		return algoRandomTwoChoices
	}
	return algoRoundRobin
}

func algoName(code uint32) service.Algorithm {
	switch code {
	case algoLeastConnections:
		return service.LeastConnections
	case algoRandomTwoChoices:
		return service.RandomTwoChoices
	}
	return service.RoundRobin
}

// view is what one pick takes into account besides the endpoint list.
type view struct {
	skip *endpoint // the sticky endpoint a retry moves away from
	// now is the time (unix nanoseconds) when some endpoint is ejected or warming up; 0 when
	// none is, and the pick never reads the clock.
	now    int64
	eject  bool  // leave out endpoints ejected at now
	window int64 // the slow-start window while some endpoint warms up; 0: every weight is 1
}

func (v *view) usable(e *endpoint) bool {
	return e != v.skip && (!v.eject || !ejectedAt(e, v.now))
}

// weight is e's share of new flows relative to a warm endpoint (slowstart.go).
func (v *view) weight(e *endpoint) float64 {
	if v.window == 0 {
		return 1
	}
	return warmWeight(e, v.now, v.window)
}

// load is e's live flows per unit of weight, what least-connections and two choices compare.
// Warm endpoints compare by plain counts (one more flow costs the same on each); a warming one
// counts as if it were 1/weight times as busy (HAProxy's and Envoy's weighted least-connections).
func (v *view) load(e *endpoint) float64 {
	a := float64(e.active.Load())
	if v.window == 0 {
		return a
	}
	return (a + 1) / v.weight(e)
}

// pick chooses an endpoint of a non-empty set with the service port's algorithm, avoiding skip
// when there is another, weighting endpoints that warm up (slow start), and leaving out
// endpoints ejected by outlier detection unless every one is (then they all serve, as in Envoy's
// panic mode: better a suspect endpoint than none).
//
// why is SlowStart when the endpoint chosen was warming up.
func (s *Service) pick(set *endpointSet, skip *endpoint) (*endpoint, flow.PickWhy) {
	v := view{skip: skip}
	if len(set.eps) == 1 {
		v.skip = nil // the only endpoint is the one to retry
	}
	s.look(&v)
	e := s.pickWith(set, &v)
	if e == nil {
		v.eject = false
		e = s.pickWith(set, &v)
	}
	if v.window != 0 && v.weight(e) < 1 {
		return e, flow.SlowStart
	}
	return e, 0
}

// flowAlgorithm names an algorithm code in the flow stream's terms.
func flowAlgorithm(code uint32) flow.Algorithm {
	switch code {
	case algoLeastConnections:
		return flow.LeastConnections
	case algoRandomTwoChoices:
		return flow.Random
	}
	return flow.RoundRobin
}

// look fills in the time-dependent part of a view. While no ejection and no warm-up is in force
// it costs two atomic loads, not a clock read.
func (s *Service) look(v *view) {
	ejectUntil, warmUntil := s.ejectHint.Load(), s.warmHint.Load()
	if ejectUntil == 0 && warmUntil == 0 {
		return
	}
	v.now = s.clock.Now().UnixNano()
	if ejectUntil != 0 {
		if v.now >= ejectUntil {
			s.ejectHint.CompareAndSwap(ejectUntil, 0) // every ejection is over
		} else {
			v.eject = true
		}
	}
	if warmUntil != 0 {
		if v.now >= warmUntil {
			s.warmHint.CompareAndSwap(warmUntil, 0) // every endpoint is warm
		} else {
			v.window = s.slowStart.Load()
		}
	}
}

// pickWith picks by the view; nil if no endpoint is usable.
func (s *Service) pickWith(set *endpointSet, v *view) *endpoint {
	switch s.algo.Load() {
	case algoLeastConnections:
		return s.leastConnections(set, v)
	case algoRandomTwoChoices:
		return s.randomTwoChoices(set, v)
	}
	n := uint64(len(set.eps))
	var declined *endpoint
	for range n {
		e := set.eps[(s.rr.Add(1)-1)%n]
		if !v.usable(e) {
			continue
		}
		// A warming endpoint takes its turn with probability weight, else passes it on: its
		// share of a round is weight times a warm endpoint's.
		if v.window != 0 {
			if w := v.weight(e); w < 1 && rand.Float64() >= w {
				declined = e
				continue
			}
		}
		return e
	}
	if declined == nil {
		// Other picks advance the counter meanwhile, so the n values drawn above need not
		// cover n different endpoints: they may all have named the one skipped or ejected. A
		// usable endpoint is never missed for that.
		for _, e := range set.eps {
			if v.usable(e) {
				return e
			}
		}
	}
	return declined
}

// leastConnections scans every endpoint for the least load: O(endpoints) atomic loads per pick,
// no lock (about 1 ns per endpoint; see BenchmarkPick). The scan starts one place further on
// each pick, so ties (all idle, typically) go round robin rather than to the first.
func (s *Service) leastConnections(set *endpointSet, v *view) *endpoint {
	n := uint64(len(set.eps))
	start := (s.rr.Add(1) - 1) % n
	var best *endpoint
	bestLoad := 0.0
	scan := func(eps []*endpoint) {
		for _, e := range eps {
			if !v.usable(e) {
				continue
			}
			if l := v.load(e); best == nil || l < bestLoad {
				best, bestLoad = e, l
			}
		}
	}
	scan(set.eps[start:])
	scan(set.eps[:start])
	return best
}

// randomTwoChoices draws two different endpoints and keeps the less loaded (Mitzenmacher's
// power of two choices: near least-connections balance at constant cost, and no herd onto one
// idle endpoint when many pickers see the same counts). math/rand/v2's top-level source is
// per-thread, so the draw takes no lock. When a draw is unusable (skipped or ejected) the other
// one serves; when both are, a least-connections scan decides.
func (s *Service) randomTwoChoices(set *endpointSet, v *view) *endpoint {
	n := uint64(len(set.eps))
	if n == 1 {
		if !v.usable(set.eps[0]) {
			return nil
		}
		return set.eps[0]
	}
	i := rand.Uint64N(n)
	j := rand.Uint64N(n - 1)
	if j >= i {
		j++
	}
	a, b := set.eps[i], set.eps[j]
	aOK, bOK := v.usable(a), v.usable(b)
	switch {
	case aOK && bOK:
		if v.load(b) < v.load(a) {
			return b
		}
		return a
	case aOK:
		return a
	case bOK:
		return b
	}
	return s.leastConnections(set, v)
}

// SetBalancing sets a service port's balancing policy.
func (lb *LoadBalancer) SetBalancing(name service.ServicePortName, b service.Balancing) {
	lb.Service(name).setBalancing(b)
}

func (s *Service) setBalancing(b service.Balancing) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.algo.Store(algoCode(b.Algorithm))
	s.setOutlier(b.Outlier)
	s.setSlowStart(b.SlowStart)
}

// Balancing returns the policy in force.
func (s *Service) Balancing() service.Balancing {
	b := service.Balancing{Algorithm: algoName(s.algo.Load())}
	if o := s.outlier.Load(); o != nil {
		b.Outlier = *o
	}
	b.SlowStart = time.Duration(s.slowStart.Load())
	return b
}

// DialDone reports how a dial to ep, picked by Next, ended: err nil when it connected (the flow
// lives on until FlowDone), else the endpoint failed it (refused, timed out, reset) and the
// flow is over. The proxies call it through their Observer interface.
func (s *Service) DialDone(ep netip.AddrPort, err error) {
	e := s.eps.Load().get(ep)
	switch {
	case e == nil:
	case err == nil:
		s.succeeded(e)
	default:
		e.release()
		s.failed(e, false)
	}
}

// FlowDone reports the end of a flow on ep: a connection or session that connected, or a pick
// whose dial was abandoned for reasons that are not the endpoint's (shutdown, out of
// descriptors). reset says the endpoint cut the flow at once (a reset before any reply, an ICMP
// port unreachable).
func (s *Service) FlowDone(ep netip.AddrPort, reset bool) {
	e := s.eps.Load().get(ep)
	if e == nil {
		return
	}
	e.release()
	switch {
	case reset:
		s.failed(e, true)
	case e.resetFails.Load() != 0:
		e.resetFails.Store(0)
	}
}

// EndpointState is one endpoint as the balancer sees it, for the debug view.
type EndpointState struct {
	Endpoint netip.AddrPort
	// Active is the live flows counted on it (dials in progress, connections, sessions).
	Active int64
	// EjectedUntil is when outlier detection lets it back into rotation; zero if it is in.
	EjectedUntil time.Time
	// Ejections is its ejections in a row (the back-off multiplier).
	Ejections int
	// Weight is its share of new flows against a warm endpoint's: below 1 while it warms up.
	Weight float64
}

// EndpointStates lists the endpoints in round-robin order with their live state.
func (s *Service) EndpointStates() []EndpointState {
	set := s.eps.Load()
	now := s.clock.Now().UnixNano()
	out := make([]EndpointState, len(set.eps))
	for i, e := range set.eps {
		out[i] = EndpointState{Endpoint: e.addr, Active: e.active.Load(), Ejections: int(e.ejections.Load()), Weight: 1}
		if w := s.slowStart.Load(); w > 0 {
			out[i].Weight = warmWeight(e, now, w)
		}
		if until := e.ejectedUntil.Load(); now < until {
			out[i].EjectedUntil = time.Unix(0, until)
		}
	}
	return out
}
