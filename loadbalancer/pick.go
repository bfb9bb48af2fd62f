package loadbalancer

import (
	"math/rand/v2"
	"net/netip"
	"time"

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

// pick chooses an endpoint of a non-empty set with the service port's algorithm, avoiding skip
// (the sticky endpoint a retry moves away from) when there is another, and endpoints ejected by
// outlier detection unless every one is (then they all serve, as in Envoy's panic mode: better a
// suspect endpoint than none).
func (s *Service) pick(set *endpointSet, skip *endpoint) *endpoint {
	now := s.ejectionNow()
	if e := s.pickAt(set, skip, now); e != nil {
		return e
	}
	return s.pickAt(set, skip, 0)
}

// pickAt picks with the endpoints ejected at now (0: none) left out; nil if none is left.
func (s *Service) pickAt(set *endpointSet, skip *endpoint, now int64) *endpoint {
	if len(set.eps) == 1 {
		skip = nil // the only endpoint is the one to retry
	}
	switch s.algo.Load() {
	case algoLeastConnections:
		return s.leastConnections(set, skip, now)
	case algoRandomTwoChoices:
		return s.randomTwoChoices(set, skip, now)
	}
	n := uint64(len(set.eps))
	for range n {
		e := set.eps[(s.rr.Add(1)-1)%n]
		if e != skip && (now == 0 || !ejectedAt(e, now)) {
			return e
		}
	}
	return nil
}

// leastConnections scans every endpoint for the fewest live flows: O(endpoints) atomic loads
// per pick, no lock (about 1 ns per endpoint; see BenchmarkPick). The scan starts one place
// further on each pick, so ties (all idle, typically) go round robin rather than to the first.
func (s *Service) leastConnections(set *endpointSet, skip *endpoint, now int64) *endpoint {
	n := uint64(len(set.eps))
	start := (s.rr.Add(1) - 1) % n
	var best *endpoint
	bestActive := int64(0)
	scan := func(eps []*endpoint) {
		for _, e := range eps {
			if e == skip || (now != 0 && ejectedAt(e, now)) {
				continue
			}
			if a := e.active.Load(); best == nil || a < bestActive {
				best, bestActive = e, a
			}
		}
	}
	scan(set.eps[start:])
	scan(set.eps[:start])
	return best
}

// randomTwoChoices draws two different endpoints and keeps the one with fewer live flows
// (Mitzenmacher's power of two choices: near least-connections balance at constant cost, and
// no herd onto one idle endpoint when many pickers see the same counts). math/rand/v2's
// top-level source is per-thread, so the draw takes no lock. When a draw is unusable (skipped or
// ejected) the other one serves; when both are, a least-connections scan decides.
func (s *Service) randomTwoChoices(set *endpointSet, skip *endpoint, now int64) *endpoint {
	n := uint64(len(set.eps))
	if n == 1 {
		if now != 0 && ejectedAt(set.eps[0], now) {
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
	aOK := a != skip && (now == 0 || !ejectedAt(a, now))
	bOK := b != skip && (now == 0 || !ejectedAt(b, now))
	switch {
	case aOK && bOK:
		if b.active.Load() < a.active.Load() {
			return b
		}
		return a
	case aOK:
		return a
	case bOK:
		return b
	}
	return s.leastConnections(set, skip, now)
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
}

// Balancing returns the policy in force.
func (s *Service) Balancing() service.Balancing {
	b := service.Balancing{Algorithm: algoName(s.algo.Load())}
	if o := s.outlier.Load(); o != nil {
		b.Outlier = *o
	}
	return b
}

// DialDone reports how a dial to ep, picked by Next, ended: err nil when it connected (the flow
// lives on until FlowDone), else the endpoint failed it (refused, timed out, reset) and the
// flow is over. The proxies call it through their Observer interface.
func (s *Service) DialDone(ep netip.AddrPort, err error) {
	e := s.eps.Load().has[ep]
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
	e := s.eps.Load().has[ep]
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
}

// EndpointStates lists the endpoints in round-robin order with their live state.
func (s *Service) EndpointStates() []EndpointState {
	set := s.eps.Load()
	now := s.clock.Now().UnixNano()
	out := make([]EndpointState, len(set.eps))
	for i, e := range set.eps {
		out[i] = EndpointState{Endpoint: e.addr, Active: e.active.Load(), Ejections: int(e.ejections.Load())}
		if until := e.ejectedUntil.Load(); now < until {
			out[i].EjectedUntil = time.Unix(0, until)
		}
	}
	return out
}
