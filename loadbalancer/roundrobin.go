// Package loadbalancer picks a pod endpoint for every new TCP connection or UDP session: round robin,
// least connections or random two choices per service port, with ClientIP session affinity on top.
// The hot path (Service.Next) takes no lock; the proxies report each flow's end with atomic counters.
package loadbalancer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ErrNoEndpoints is returned by Next when the service port has no usable endpoint.
var ErrNoEndpoints = errors.New("missing endpoints")

// ErrMissingService is returned by LoadBalancer.NextEndpoint for a service port it does not know.
var ErrMissingService = errors.New("missing service entry")

// LoadBalancer holds one Service balancer per service port. Its map lock is taken only to find or
// change a balancer, never while picking, so services do not serialise behind each other (the
// legacy LoadBalancerRR took one write lock for every pick of every service).
type LoadBalancer struct {
	clock   clock.PassiveClock
	shuffle func([]netip.AddrPort)

	mu       sync.RWMutex
	services map[service.ServicePortName]*Service
	hook     atomic.Pointer[func(Ejection)] // shared with every Service
}

// New returns an empty load balancer that reads time from c.
func New(c clock.PassiveClock) *LoadBalancer {
	return &LoadBalancer{
		clock:    c,
		shuffle:  func(eps []netip.AddrPort) { rand.Shuffle(len(eps), func(i, j int) { eps[i], eps[j] = eps[j], eps[i] }) },
		services: make(map[service.ServicePortName]*Service),
	}
}

// Service returns the balancer of a service port, creating an empty one (no endpoints, no
// affinity) if needed. Proxy sockets keep the handle and call Next on it directly.
func (lb *LoadBalancer) Service(name service.ServicePortName) *Service {
	lb.mu.RLock()
	s := lb.services[name]
	lb.mu.RUnlock()
	if s != nil {
		return s
	}
	lb.mu.Lock()
	defer lb.mu.Unlock()
	if s = lb.services[name]; s == nil {
		s = newService(name, lb.clock, lb.shuffle)
		s.hook = &lb.hook
		lb.services[name] = s
	}
	return s
}

func (lb *LoadBalancer) lookup(name service.ServicePortName) *Service {
	lb.mu.RLock()
	defer lb.mu.RUnlock()
	return lb.services[name]
}

// SetAffinity sets the affinity type and timeout of a service port. Unlike the legacy balancer it
// applies the timeout also when the balancer already exists (endpoints often arrive first,
// kubernetes#107398) and when only the timeout changes.
func (lb *LoadBalancer) SetAffinity(name service.ServicePortName, a service.Affinity) {
	lb.Service(name).setAffinity(a)
}

// SetEndpoints replaces the endpoints of a service port. Clients stuck to surviving endpoints keep
// them; clients of removed endpoints are re-homed on their next pick.
func (lb *LoadBalancer) SetEndpoints(name service.ServicePortName, eps []netip.AddrPort) {
	lb.Service(name).setEndpoints(eps)
}

// SetPickWhy sets why a service port's endpoint set is what it is (Service.SetPickWhy): the
// proxier calls it with each SetEndpoints whose endpoints it narrowed (topology) or widened
// (a Local policy's fallback, only terminating endpoints left).
func (lb *LoadBalancer) SetPickWhy(name service.ServicePortName, why flow.PickWhy) {
	lb.Service(name).SetPickWhy(why)
}

// DeleteService forgets a service port and its affinity entries.
func (lb *LoadBalancer) DeleteService(name service.ServicePortName) {
	lb.mu.Lock()
	delete(lb.services, name)
	lb.mu.Unlock()
}

// NextEndpoint picks an endpoint for client on a service port (see Service.Next).
func (lb *LoadBalancer) NextEndpoint(name service.ServicePortName, client netip.Addr, reset bool) (netip.AddrPort, error) {
	s := lb.lookup(name)
	if s == nil {
		return netip.AddrPort{}, fmt.Errorf("service %s: %w", name, ErrMissingService)
	}
	return s.Next(client, reset)
}

// CleanupStaleAffinity removes expired affinity entries of every service port, one shard at a time
// so no pick waits for the whole sweep. It returns how many entries it removed.
func (lb *LoadBalancer) CleanupStaleAffinity() int {
	lb.mu.RLock()
	all := make([]*Service, 0, len(lb.services))
	for _, s := range lb.services {
		all = append(all, s)
	}
	lb.mu.RUnlock()
	n := 0
	for _, s := range all {
		n += s.cleanupStale()
	}
	return n
}

// Names lists the service ports the balancer knows, sorted.
func (lb *LoadBalancer) Names() []service.ServicePortName {
	lb.mu.RLock()
	names := make([]service.ServicePortName, 0, len(lb.services))
	for n := range lb.services {
		names = append(names, n)
	}
	lb.mu.RUnlock()
	sort.Slice(names, func(i, j int) bool { return names[i].String() < names[j].String() })
	return names
}

// Lookup returns the balancer of a service port, or nil.
func (lb *LoadBalancer) Lookup(name service.ServicePortName) *Service { return lb.lookup(name) }

// endpoint is one endpoint's live state. It outlives endpoint-set replacements (an endpoint that
// stays keeps its entry), so its flow count stays right across EndpointSlice updates.
type endpoint struct {
	addr netip.AddrPort
	// active counts flows picked and not yet reported done: a dial in progress, a connection or
	// a UDP session. Least-connections and random-two-choices read it; the proxies keep it
	// (see Observer methods DialDone and FlowDone).
	active atomic.Int64

	// Outlier detection (outlier.go): the current streaks of failed dials and of immediate
	// resets, the ejections in a row, and until when (unix nanoseconds) it is out of rotation.
	dialFails, resetFails atomic.Int32
	ejections             atomic.Int32
	ejectedUntil          atomic.Int64
	// warmFrom is when its slow-start window began (unix nanoseconds): when it joined a service
	// port that had endpoints already, or came back from an ejection (slowstart.go).
	warmFrom atomic.Int64
	// ref names its pod and node for the flow stream (SetEndpointRefs; nil if not known).
	ref atomic.Pointer[flow.EndpointRef]
}

// release ends one counted flow. A flow picked before its endpoint was removed and re-added
// ends on the new entry, which never counted it, so the count stops at 0.
func (e *endpoint) release() {
	for {
		v := e.active.Load()
		if v <= 0 || e.active.CompareAndSwap(v, v-1) {
			return
		}
	}
}

// endpointSet is an immutable endpoint list, replaced whole on every change.
type endpointSet struct {
	list []netip.AddrPort
	eps  []*endpoint // eps[i] is list[i]'s entry
	// has indexes a large set (more than smallSet endpoints); a small one is searched in list.
	// At 10,000 service ports of 5 endpoints, a map per set held about half of the balancer's
	// 11 MB, and scanning 5 addresses is as fast as hashing one.
	has map[netip.AddrPort]*endpoint
}

// smallSet is the size up to which an endpoint set has no map.
const smallSet = 16

// get returns ep's entry, or nil when ep is not in the set.
func (s *endpointSet) get(ep netip.AddrPort) *endpoint {
	if s.has != nil {
		return s.has[ep]
	}
	for i, a := range s.list {
		if a == ep {
			return s.eps[i]
		}
	}
	return nil
}

// newEndpointSet builds the set of eps, reusing old's entries for endpoints that stay; order is
// the order of eps after shuffle.
func newEndpointSet(eps []netip.AddrPort, old *endpointSet, shuffle func([]netip.AddrPort)) *endpointSet {
	set := &endpointSet{list: make([]netip.AddrPort, 0, len(eps)), eps: make([]*endpoint, 0, len(eps))}
	if len(eps) > smallSet {
		set.has = make(map[netip.AddrPort]*endpoint, len(eps))
	}
	for _, ep := range eps {
		if !ep.IsValid() || set.get(ep) != nil {
			continue
		}
		e := (*endpoint)(nil)
		if old != nil {
			e = old.get(ep)
		}
		if e == nil {
			e = &endpoint{addr: ep}
		}
		if set.has != nil {
			set.has[ep] = e
		}
		set.list = append(set.list, ep)
		set.eps = append(set.eps, e)
	}
	if shuffle != nil && len(set.list) > 1 {
		unshuffled := &endpointSet{list: slices.Clone(set.list), eps: slices.Clone(set.eps), has: set.has}
		shuffle(set.list)
		for i, ep := range set.list {
			set.eps[i] = unshuffled.get(ep)
		}
	}
	return set
}

func (s *endpointSet) sameMembers(o *endpointSet) bool {
	if len(s.list) != len(o.list) {
		return false
	}
	for _, ep := range s.list {
		if o.get(ep) == nil {
			return false
		}
	}
	return true
}

// Service balances one service port. Its methods are safe for concurrent use.
type Service struct {
	name    service.ServicePortName
	clock   clock.PassiveClock
	shuffle func([]netip.AddrPort)

	eps atomic.Pointer[endpointSet]
	// rr is never reset: a counter that keeps running across endpoint updates keeps round robin
	// fair when endpoints churn (a reset to 0 would favour whichever endpoint lands first).
	// Least-connections uses it to rotate where its scan starts, so ties spread too.
	rr       atomic.Uint64
	algo     atomic.Uint32 // an algorithm constant
	clientIP atomic.Bool
	ttl      atomic.Int64 // nanoseconds

	// writeMu orders endpoint, affinity and policy updates; picks never take it.
	writeMu sync.Mutex
	// affinity exists only while ClientIP affinity is on: most service ports never use it, and at
	// 10,000 service ports an eager table per port cost ~50 MB.
	affinity atomic.Pointer[affinityTable]

	// Outlier detection (outlier.go): the policy (nil: off), the latest end of an ejection in
	// force (0: none, so picks skip the clock), and the ejections so far.
	outlier        atomic.Pointer[service.Outlier]
	ejectHint      atomic.Int64
	ejectMu        sync.Mutex
	ejectionsTotal atomic.Uint64
	hook           *atomic.Pointer[func(Ejection)]

	// Slow start (slowstart.go): the window (nanoseconds, 0: off) and the latest end of a
	// warm-up in force (0: none, so picks skip the clock).
	slowStart atomic.Int64
	warmHint  atomic.Int64

	// setWhy is the endpoint set's flow.PickWhy (SetPickWhy).
	setWhy atomic.Uint32
}

func newService(name service.ServicePortName, c clock.PassiveClock, shuffle func([]netip.AddrPort)) *Service {
	s := &Service{name: name, clock: c, shuffle: shuffle, hook: &atomic.Pointer[func(Ejection)]{}}
	s.eps.Store(newEndpointSet(nil, nil, nil))
	s.ttl.Store(int64(service.DefaultAffinityTimeout))
	return s
}

// Name is the service port this balancer serves.
func (s *Service) Name() service.ServicePortName { return s.name }

// Endpoints returns the current endpoints in round-robin order.
func (s *Service) Endpoints() []netip.AddrPort { return slices.Clone(s.eps.Load().list) }

// NumEndpoints is len(Endpoints()) without the copy (the /metrics scrape reads it for every
// service port).
func (s *Service) NumEndpoints() int { return len(s.eps.Load().list) }

// HasEndpoints reports whether a pick can succeed.
func (s *Service) HasEndpoints() bool { return len(s.eps.Load().list) > 0 }

// Affinity returns the affinity settings in force.
func (s *Service) Affinity() service.Affinity {
	return service.Affinity{ClientIP: s.clientIP.Load(), Timeout: time.Duration(s.ttl.Load())}
}

// Next picks the endpoint for a new connection or session from client, with the service port's
// algorithm, and counts a flow on it (the proxies report its end; see DialDone and FlowDone).
// With ClientIP affinity a client that used an endpoint within the TTL gets it again (and the TTL
// slides); the algorithm places new clients. reset=true is for a retry after a failed dial: the
// sticky endpoint is skipped and the entry rewritten.
func (s *Service) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	e, _, err := s.next(client, reset)
	if err != nil {
		return netip.AddrPort{}, err
	}
	return s.take(e), nil
}

// NextWhy is Next that also says how it chose (the proxies' Explainer, for the live flow stream):
// the algorithm in force, and why beyond it: Affinity when the client's sticky endpoint was
// reused, Retry for reset=true, SlowStart when the endpoint was warming up, and the endpoint
// set's own reasons (SetPickWhy).
func (s *Service) NextWhy(client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	e, why, err := s.next(client, reset)
	if err != nil {
		return netip.AddrPort{}, flow.Pick{}, err
	}
	if reset {
		why |= flow.Retry
	}
	why |= flow.PickWhy(s.setWhy.Load())
	return s.take(e), flow.Pick{Algorithm: flowAlgorithm(s.algo.Load()), Why: why, Ref: e.ref.Load()}, nil
}

// SetEndpointRefs names the pods and nodes of a service port's current endpoints (ref returns
// nil for one it cannot name), for the picks NextWhy explains. Call it after SetEndpoints; an
// endpoint keeps its ref while it stays in the set.
func (lb *LoadBalancer) SetEndpointRefs(name service.ServicePortName, ref func(netip.AddrPort) *flow.EndpointRef) {
	s := lb.Service(name)
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	for _, e := range s.eps.Load().eps {
		if r := ref(e.addr); r == nil || e.ref.Load() == nil || *e.ref.Load() != *r {
			e.ref.Store(r)
		}
	}
}

// SetPickWhy records why the endpoint set is what it is (Topology, Local, Terminating:
// the proxier narrows the endpoints before SetEndpoints), OR'ed into every NextWhy's reasons.
func (s *Service) SetPickWhy(why flow.PickWhy) { s.setWhy.Store(uint32(why)) }

// next is Next's choice, before the flow is counted on it; why says Affinity or SlowStart.
func (s *Service) next(client netip.Addr, reset bool) (*endpoint, flow.PickWhy, error) {
	set := s.eps.Load()
	if len(set.list) == 0 {
		return nil, 0, fmt.Errorf("service %s: %w", s.name, ErrNoEndpoints)
	}
	if !s.clientIP.Load() {
		e, why := s.pick(set, nil)
		return e, why, nil
	}
	table := s.affinity.Load()
	if table == nil { // affinity is being turned on or off right now
		e, why := s.pick(set, nil)
		return e, why, nil
	}
	now := s.clock.Now().UnixNano()
	sh := table.shard(client)
	sticky := sh.get(client)
	var skip *endpoint
	if sticky != nil {
		e := set.get(sticky.endpoint)
		if e != nil && ejectedAt(e, now) {
			e = nil // out of rotation: the client moves, as if its endpoint were gone
		}
		if !reset && e != nil && now-sticky.lastUsed.Load() < s.ttl.Load() {
			sticky.lastUsed.Store(now)
			return e, flow.Affinity, nil
		}
		if reset {
			skip = e
		}
	}
	e, why := s.pick(set, skip)
	sh.put(client, e.addr, now)
	return e, why, nil
}

func (s *Service) take(e *endpoint) netip.AddrPort {
	e.active.Add(1)
	return e.addr
}

func (s *Service) setAffinity(a service.Affinity) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.ttl.Store(int64(a.TTL()))
	switch {
	case a.ClientIP && s.affinity.Load() == nil:
		t := &affinityTable{}
		t.init()
		s.affinity.Store(t) // before clientIP, so a pick that sees ClientIP finds the table
		s.clientIP.Store(true)
	case !a.ClientIP:
		s.clientIP.Store(false)
		s.affinity.Store(nil) // forget every client
	}
}

func (s *Service) setEndpoints(eps []netip.AddrPort) {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	old := s.eps.Load()
	next := newEndpointSet(eps, old, nil)
	if old.sameMembers(next) {
		return
	}
	next = newEndpointSet(eps, old, s.shuffle)
	if len(old.eps) > 0 && s.slowStart.Load() > 0 {
		// Endpoints that join a serving set warm up; a first set (a new service port, a
		// restarted proxy) takes traffic at once, as nothing else could.
		now := s.clock.Now().UnixNano()
		for _, e := range next.eps {
			if old.get(e.addr) != e {
				s.warmFrom(e, now)
			}
		}
	}
	s.eps.Store(next)
	if t := s.affinity.Load(); t != nil {
		t.removeIf(func(e *affinityEntry) bool {
			return next.get(e.endpoint) == nil
		})
	}
}

func (s *Service) cleanupStale() int {
	now := s.clock.Now().UnixNano()
	ttl := s.ttl.Load()
	t := s.affinity.Load()
	if t == nil {
		return 0
	}
	return t.removeIf(func(e *affinityEntry) bool { return now-e.lastUsed.Load() >= ttl })
}

// AffinityEntry is one client's sticky endpoint, for the debug view.
type AffinityEntry struct {
	Client   netip.Addr
	Endpoint netip.AddrPort
	LastUsed time.Time
}

// AffinityEntries lists the current sticky clients, sorted by client address.
func (s *Service) AffinityEntries() []AffinityEntry {
	var out []AffinityEntry
	if t := s.affinity.Load(); t != nil {
		out = t.entries()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Client.Less(out[j].Client) })
	return out
}
