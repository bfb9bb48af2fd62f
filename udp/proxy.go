// Package udp proxies the datagrams of one UDP service port: a listening socket, a session per
// client address with its own socket connected to the endpoint picked for it, replies sent back
// from the listening socket so conntrack un-NATs them to the service address, idle expiry on an
// injected clock and a bounded, least-recently-used session table.
package udp

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// DefaultIdleTimeout is how long a session lives without traffic in either direction.
//
// The trade-off: a session must outlive the slowest reply it should carry. DNS is the main UDP
// service, and a cluster DNS server forwarding upstream answers after up to its upstream timeout
// (CoreDNS forward and skydns: 2 s; resolvers commonly 5 s). The legacy 250 ms dropped those
// answers (kubernetes#14939). A longer timeout costs one backend socket (a descriptor and a little
// kernel memory) per client address for that long; stub resolvers use a fresh source port per
// query, so a DNS service holds about queries/s × IdleTimeout sessions, bounded by MaxSessions.
// 10 s covers a 5 s upstream timeout with margin and stays well under conntrack's 30 s UDP timeout,
// so the portal's conntrack entry outlives the session.
const DefaultIdleTimeout = 10 * time.Second

// DefaultMaxSessions bounds the sessions (and so backend sockets) of one service port. When it is
// reached the least recently active session is evicted. A session then lives at least
// min(IdleTimeout, MaxSessions / new clients per second): 16384 keeps 8 s at 2000 new clients/s.
// A flood of spoofed sources costs at most this many descriptors per service port.
const DefaultMaxSessions = 16384

// Picker chooses the endpoint for a client. reset=true asks for a new pick that skips the client's
// sticky endpoint, after that endpoint refused a datagram.
type Picker interface {
	Next(client netip.Addr, reset bool) (netip.AddrPort, error)
}

// Gate is implemented by a Picker that cannot pick yet: a restarted proxy's, before it has its
// endpoints. Run reads no datagram until Ready is closed, so datagrams wait in the socket's queue
// (or, after a hand-over, go to the predecessor still reading the same socket) instead of being
// dropped for want of an endpoint.
type Gate interface {
	Ready() <-chan struct{}
}

// Config tunes a Proxy. The zero value is usable.
type Config struct {
	// IdleTimeout (--udp-timeout) ends a session after this long without traffic either way.
	// 0 means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// MaxSessions per service port; 0 means DefaultMaxSessions.
	MaxSessions int
	// BatchSize is how many datagrams one recvmmsg/sendmmsg moves (1..32); 0 means
	// DefaultBatchSize, and 1 makes it a plain one-datagram-per-syscall loop. Batching won on
	// proxy CPU per exchange in all twelve bench/udp runs (32 clients, 64-byte request/response),
	// by 1-28%: under load a pass finds several replies and sends them with one sendmmsg, and
	// its packet rate was as high or higher. See README.md.
	BatchSize int
	// Loops is how many loops serve the port, each on its own socket of an SO_REUSEPORT group
	// with its own sessions (1..maxLoops); 0 means DefaultLoops. MaxSessions is split evenly
	// between them. See DefaultLoops for why one is the default.
	Loops int
	// Clock drives idle expiry; nil means the real clock.
	Clock  clock.Clock
	Logger logrus.FieldLogger
	// FreeBind lets Listen bind an address that is not local yet (bind portal mode).
	FreeBind bool
	// Allow, if set, is asked about a client's address when its datagram would open a session;
	// a client it denies gets no session: the datagram is dropped before any endpoint is picked,
	// and counted in Stats.SourceDenied (loadBalancerSourceRanges on a socket listening on a
	// load-balancer IP in bind portal mode). Nil allows every client and costs nothing. It runs
	// on the proxy loop and must be quick.
	Allow func(client netip.Addr) bool
	// OnEnd, if set, is called once per ended session (the access log), from the goroutine that
	// ended it and without proxy locks held. It must not block for long.
	OnEnd func(flow.Info)
	// Adopt, if set, is asked by Listen for a socket already bound to the address, handed over
	// by the process this one replaces (package handover); the proxy takes ownership of the
	// descriptor and binds nothing, so datagrams queued meanwhile are not lost. Nil, or no
	// socket for the address, means Listen binds as usual.
	Adopt func(addr netip.AddrPort) (fd int, ok bool)
	// Flows, if set, gets an event when a session starts (its endpoint picked and its socket
	// open) and when it ends; a datagram dropped before any session (no endpoint, a denied
	// source) reports an End of its own. It is called on the proxy loop with the loop's lock
	// held and must not block. If it implements flow.Capturer, a session it captures hands
	// every datagram to the Tap. Nil costs nothing.
	Flows flow.Recorder
	// Source, if set, is asked when a session opens whether its socket takes the client's
	// address and port instead of the proxy's (transparent.go; the node must steer the
	// endpoint's replies back to the proxy). A socket that cannot take the client's address
	// falls back to the proxy's (Stats: TransparentDials, TransparentFallbacks). Nil costs nothing.
	Source flow.SourcePolicy
}

func (c Config) withDefaults() Config {
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.MaxSessions <= 0 {
		c.MaxSessions = DefaultMaxSessions
	}
	if c.BatchSize <= 0 {
		c.BatchSize = DefaultBatchSize
	}
	c.BatchSize = min(c.BatchSize, maxBatch)
	if c.Loops <= 0 {
		c.Loops = DefaultLoops
	}
	c.Loops = min(c.Loops, maxLoops)
	if c.Clock == nil {
		c.Clock = clock.RealClock{}
	}
	if c.Logger == nil {
		c.Logger = logrus.StandardLogger()
	}
	return c
}

// Proxy serves one UDP service port with Config.Loops loops (shards), each on its own socket of
// the port's SO_REUSEPORT group with its own sessions: the kernel steers every datagram of one
// client address and port to the same socket, so a client's session lives in one loop and its
// datagrams keep their order.
//
// Concurrency: each shard's goroutine does its sockets' I/O under the shard's lock (see shard).
// mu guards the Proxy's own state; it is taken before a shard's lock, never after. The control
// methods (DropEndpoint, Live, Close, Shutdown, ...) work whether or not Run is going.
type Proxy struct {
	name   service.ServicePortName
	picker Picker
	cfg    Config
	log    logrus.FieldLogger
	stats  counters

	// drained is closed once every shard is drained (released or closed with no session left),
	// or the proxy is closed.
	drained   chan struct{}
	drainOne  sync.Once
	undrained atomic.Int32
	stopped   chan struct{} // closed by Close

	mu       sync.Mutex
	closed   bool
	released bool
	running  bool
	addr     netip.AddrPort
	adopted  bool // Listen took a handed-over socket (Config.Adopt)
	shards   []*shard
}

// New returns a proxy for the service port. It opens nothing: call Listen, then Run.
func New(name service.ServicePortName, picker Picker, cfg Config) *Proxy {
	cfg = cfg.withDefaults()
	return &Proxy{
		name:    name,
		picker:  picker,
		cfg:     cfg,
		log:     cfg.Logger.WithField("service", name.String()),
		drained: make(chan struct{}),
		stopped: make(chan struct{}),
	}
}

// Listen opens the service port's sockets on addr (port 0 lets the kernel choose; see Addr).
func (p *Proxy) Listen(addr netip.AddrPort) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return fmt.Errorf("udp %s: listen %s: %w", p.name, addr, os.ErrClosed)
	case len(p.shards) > 0:
		return fmt.Errorf("udp %s: listen %s: already listening on %s", p.name, addr, p.addr)
	}
	fds, bound, adopted, err := p.openGroup(addr)
	if err != nil {
		return fmt.Errorf("udp %s: listen %s: %w", p.name, addr, err)
	}
	perShard := (p.cfg.MaxSessions + len(fds) - 1) / len(fds)
	shards := make([]*shard, 0, len(fds))
	for i, fd := range fds {
		s, err := newShard(p, fd, perShard)
		if err != nil {
			closeFDs(fds[i+1:])
			for _, s := range shards {
				s.close()
				s.closeIO()
			}
			return fmt.Errorf("udp %s: listen %s: %w", p.name, addr, err)
		}
		shards = append(shards, s)
	}
	p.undrained.Store(int32(len(shards)))
	p.shards, p.addr, p.adopted = shards, bound, adopted
	return nil
}

// openGroup opens the listening sockets: every socket handed over for addr (Config.Adopt; a
// predecessor with several loops hands over several), then, up to Config.Loops, new members of
// their SO_REUSEPORT group. The first socket is bound without SO_REUSEPORT and gets it only once
// bound: a socket binding port 0 with SO_REUSEPORT may be given the port of another group of the
// same user (another service port's proxy), and would take a share of its datagrams. A member
// that cannot be added costs a loop, not the port: it is logged, and the port runs with fewer.
func (p *Proxy) openGroup(addr netip.AddrPort) (fds []int, bound netip.AddrPort, adopted bool, err error) {
	if p.cfg.Adopt != nil && addr.Port() != 0 {
		for len(fds) < maxLoops {
			fd, ok := p.cfg.Adopt(addr)
			if !ok {
				break
			}
			if fd, bound, err = adoptUDP(fd, addr); err != nil {
				closeFDs(fds)
				return nil, bound, false, err
			}
			fds = append(fds, fd)
		}
	}
	adopted = len(fds) > 0
	if !adopted {
		fd, b, err := listenUDP(addr, p.cfg.FreeBind, false)
		if err != nil {
			return nil, b, false, err
		}
		fds, bound = []int{fd}, b
	}
	return p.growGroup(fds, bound, p.cfg.Loops), bound, adopted, nil
}

// growGroup adds members to the group of fds (bound to bound) up to want and returns them all.
func (p *Proxy) growGroup(fds []int, bound netip.AddrPort, want int) []int {
	if len(fds) >= want {
		return fds
	}
	if err := enableReusePort(fds[0]); err != nil {
		p.log.WithError(err).Warn("UDP service port runs one loop")
		return fds
	}
	for len(fds) < want {
		fd, _, err := listenUDP(bound, p.cfg.FreeBind, true)
		if err != nil {
			p.log.WithError(err).WithField("loops", len(fds)).Warn("UDP service port runs fewer loops")
			break
		}
		fds = append(fds, fd)
	}
	return fds
}

// Adopted reports whether Listen took a handed-over socket instead of binding one.
func (p *Proxy) Adopted() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.adopted
}

// Addr is the address Listen bound, with the kernel-chosen port.
func (p *Proxy) Addr() netip.AddrPort {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr
}

// Run proxies datagrams until ctx is done or Close is called, and closes the proxy when it
// returns.
func (p *Proxy) Run(ctx context.Context) error {
	p.mu.Lock()
	switch {
	case p.closed:
		p.mu.Unlock()
		return nil
	case len(p.shards) == 0:
		p.mu.Unlock()
		return fmt.Errorf("udp %s: run: not listening", p.name)
	case p.running:
		p.mu.Unlock()
		return fmt.Errorf("udp %s: run: already running", p.name)
	}
	p.running = true
	shards := p.shards
	p.mu.Unlock()

	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { p.expireLoop(ctx, stop) })
	if g, ok := p.picker.(Gate); ok {
		select {
		case <-g.Ready():
		case <-ctx.Done(): // expireLoop closes the proxy; serve sees it
		case <-p.stopped:
		}
	}
	errs := make([]error, len(shards))
	var loops sync.WaitGroup
	ns, err := p.serveExtraLoops(&loops, shards[1:], errs[1:])
	if err != nil {
		errs[0] = err
	} else {
		errs[0] = shards[0].serve()
	}
	p.Close()
	loops.Wait()
	if ns != nil {
		ns.Close()
	}
	close(stop)
	wg.Wait()
	p.Close()
	for _, s := range p.shardList() {
		if err := s.closeIO(); err != nil {
			errs = append(errs, err)
		}
	}
	p.mu.Lock()
	p.running = false
	p.mu.Unlock()
	return errors.Join(errs...)
}

// serveExtraLoops starts the loops of shards on goroutines of their own, in the caller's network
// namespace (see netns.go), each recording its error in errs. The caller closes ns after they
// are done.
func (p *Proxy) serveExtraLoops(loops *sync.WaitGroup, shards []*shard, errs []error) (ns *os.File, err error) {
	if len(shards) == 0 {
		return nil, nil
	}
	if ns, err = callerNetns(); err != nil {
		return nil, fmt.Errorf("udp %s: %w", p.name, err)
	}
	for i, s := range shards {
		loops.Go(func() {
			if err := enterNetns(ns); err != nil {
				errs[i] = fmt.Errorf("udp %s: loop %d: %w", p.name, i+1, err)
			} else {
				errs[i] = s.serve()
			}
			p.Close() // one loop failing stops the port: its clients would get no answer
		})
	}
	return ns, nil
}

// expireLoop ends idle sessions on the injected clock, and closes the proxy when ctx is done.
func (p *Proxy) expireLoop(ctx context.Context, stop <-chan struct{}) {
	interval := sweepInterval(p.cfg.IdleTimeout)
	t := p.cfg.Clock.NewTimer(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			p.Close()
			return
		case <-stop:
			return
		case <-t.C():
			for _, s := range p.shardList() {
				s.expire()
			}
			t.Reset(interval)
		}
	}
}

// sweepInterval sets how late past its timeout a session may end: a quarter of the timeout,
// between 10 ms and 1 s.
func sweepInterval(timeout time.Duration) time.Duration {
	return min(max(timeout/4, 10*time.Millisecond), time.Second)
}

func (p *Proxy) shardList() []*shard {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shards
}

// Close closes the listening sockets and every session. It is safe to call more than once and
// concurrently with Run, which then returns.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.stopped)
	var errs []error
	var ended []flow.Info
	for _, s := range p.shards {
		e, err := s.close()
		ended = append(ended, e...)
		if err != nil {
			errs = append(errs, err)
		}
	}
	if !p.running {
		for _, s := range p.shards {
			if err := s.closeIO(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	p.markDrained()
	p.mu.Unlock()
	report(p.cfg.OnEnd, ended)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("udp %s: close: %w", p.name, err)
	}
	return nil
}

// SetRefusing closes the listening sockets (on) or opens them again on the same address (off),
// while the proxy stays. With no socket bound to its address the kernel answers a datagram with
// ICMP port unreachable, so a client learns at once that nobody serves it (ECONNREFUSED on a
// connected socket), as the portal rules refuse a service port without endpoints in iptables
// mode. Closing ends every session. For bind portal mode, where the sockets listen on the service
// address itself. It fails if the address cannot be bound again; after Close it does nothing.
func (p *Proxy) SetRefusing(on bool) error {
	p.mu.Lock()
	if p.closed || p.released || len(p.shards) == 0 || on != p.shards[0].listening() {
		p.mu.Unlock()
		return nil
	}
	var errs []error
	var ended []flow.Info
	if on {
		for _, s := range p.shards {
			e, err := s.refuse()
			ended = append(ended, e...)
			if err != nil {
				errs = append(errs, err)
			}
		}
	} else if err := p.relisten(); err != nil {
		errs = append(errs, err)
	}
	p.mu.Unlock()
	report(p.cfg.OnEnd, ended)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("udp %s: refusing=%t: %w", p.name, on, err)
	}
	return nil
}

// relisten binds the listening sockets again on their address, one per shard; a shard whose
// socket cannot join the group stays without one (its share of clients goes to the others).
// Called with mu held.
func (p *Proxy) relisten() error {
	fd, _, err := listenUDP(p.addr, p.cfg.FreeBind, false)
	if err != nil {
		return fmt.Errorf("listen again on %s: %w", p.addr, err)
	}
	fds := p.growGroup([]int{fd}, p.addr, len(p.shards))
	var errs []error
	for i, s := range p.shards {
		if i >= len(fds) {
			break
		}
		if err := s.listenAgain(fds[i]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Release stops reading client datagrams, so that a successor holding the same sockets (a
// hand-over) gets every new one, and keeps the sessions that may still carry a reply: their
// replies still leave through the sockets, so conntrack un-NATs them. A session whose client's
// last datagram was answered ends once quiet for releasedQuiet (a second), one still waiting for
// its reply at its idle timeout as before (a resolver's answer after a 5 s upstream timeout still
// arrives). So the old process of a hand-over exits as soon as the replies it owes are out, not at
// its drain deadline because clients are idle. Drained is closed once no session is left; Close
// ends them at once.
func (p *Proxy) Release() {
	p.mu.Lock()
	p.released = true
	shards := p.shards
	p.mu.Unlock()
	if len(shards) == 0 {
		p.markDrained() // nothing to drain
	}
	var ended []flow.Info
	for _, s := range shards {
		ended = append(ended, s.release()...)
	}
	report(p.cfg.OnEnd, ended)
}

// DefaultReleasedQuiet is how long a released proxy keeps an answered session without traffic: a
// reply in several datagrams, or a second reply to one request, still finds it.
const DefaultReleasedQuiet = time.Second

// releasedQuiet is DefaultReleasedQuiet, or the idle timeout when that is shorter.
func releasedQuiet(idle time.Duration) time.Duration { return min(idle, DefaultReleasedQuiet) }

// Drained is closed once the proxy is released with no session left, or closed.
func (p *Proxy) Drained() <-chan struct{} { return p.drained }

// shardDrained counts a drained shard; the last one drains the proxy.
func (p *Proxy) shardDrained() {
	if p.undrained.Add(-1) == 0 {
		p.markDrained()
	}
}

func (p *Proxy) markDrained() { p.drainOne.Do(func() { close(p.drained) }) }

// Shutdown is Close: a UDP proxy has no connection that could outlive its socket, so closing
// already ends every session. It is here so that both proxies stop alike.
func (p *Proxy) Shutdown() { _ = p.Close() }

// DropEndpoint ends every session whose endpoint is ep (the endpoint went away) and returns how
// many. The clients' next datagrams open new sessions to a live endpoint.
func (p *Proxy) DropEndpoint(ep netip.AddrPort) int { return p.endEndpoint(ep, flow.EndpointRemoved) }

// DrainEndpoint ends every session whose endpoint is ep because its drain deadline passed, and
// returns how many. UDP has no FIN to send first, so grace is not used: the clients' next
// datagrams open new sessions to an endpoint in the rotation.
func (p *Proxy) DrainEndpoint(ep netip.AddrPort, grace time.Duration) int {
	return p.endEndpoint(ep, flow.DrainTimeout)
}

func (p *Proxy) endEndpoint(ep netip.AddrPort, reason flow.EndReason) int {
	total := 0
	for _, s := range p.shardList() {
		n, ended := s.endEndpoint(ep, reason)
		total += n
		report(p.cfg.OnEnd, ended)
	}
	return total
}

// Stats returns the counters. It takes no lock.
func (p *Proxy) Stats() flow.Stats { return p.stats.snapshot() }

// Live is a snapshot of the live sessions, oldest first.
func (p *Proxy) Live() []flow.Info {
	var out []flow.Info
	for _, s := range p.shardList() {
		out = s.live(out)
	}
	slices.SortStableFunc(out, func(a, b flow.Info) int { return a.Start.Compare(b.Start) })
	return out
}
