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
	if c.Clock == nil {
		c.Clock = clock.RealClock{}
	}
	if c.Logger == nil {
		c.Logger = logrus.StandardLogger()
	}
	return c
}

// Proxy serves one UDP service port.
//
// Concurrency: Run's goroutine does all socket I/O. The session table is guarded by mu, which the
// loop takes once per batch of ready sockets (not per datagram); the expiry timer and the control
// methods (DropEndpoint, Live, Close, Shutdown) take it too, so they work whether or not Run is going.
type Proxy struct {
	name   service.ServicePortName
	picker Picker
	cfg    Config
	log    logrus.FieldLogger
	stats  counters

	mu       sync.Mutex
	closed   bool
	released bool          // Release: no more client datagrams are read
	drained  chan struct{} // closed once released (or closed) with no session left
	drainOne sync.Once
	stopped  chan struct{} // closed by Close
	running  bool
	lfd      int // listening socket, -1 until Listen
	addr     netip.AddrPort
	adopted  bool // Listen took a handed-over socket (Config.Adopt)
	poll     *poller
	sessions map[netip.AddrPort]*session
	byFD     map[int32]*session
	lru      lru
	ended    []flow.Info // waiting for OnEnd, reported outside mu
	lastWarn time.Time
}

// New returns a proxy for the service port. It opens nothing: call Listen, then Run.
func New(name service.ServicePortName, picker Picker, cfg Config) *Proxy {
	cfg = cfg.withDefaults()
	return &Proxy{
		name:     name,
		picker:   picker,
		cfg:      cfg,
		log:      cfg.Logger.WithField("service", name.String()),
		lfd:      -1,
		drained:  make(chan struct{}),
		stopped:  make(chan struct{}),
		sessions: make(map[netip.AddrPort]*session),
		byFD:     make(map[int32]*session),
	}
}

// Listen opens the service port's socket on addr (port 0 lets the kernel choose; see Addr).
func (p *Proxy) Listen(addr netip.AddrPort) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return fmt.Errorf("udp %s: listen %s: %w", p.name, addr, os.ErrClosed)
	case p.lfd >= 0:
		return fmt.Errorf("udp %s: listen %s: already listening on %s", p.name, addr, p.addr)
	}
	fd, bound, adopted, err := p.listenOrAdopt(addr)
	if err != nil {
		return fmt.Errorf("udp %s: listen %s: %w", p.name, addr, err)
	}
	poll, err := newPoller(2 * maxBatch)
	if err == nil {
		if err = poll.add(fd); err != nil {
			poll.close()
		}
	}
	if err != nil {
		closeFD(fd)
		return fmt.Errorf("udp %s: listen %s: %w", p.name, addr, err)
	}
	p.lfd, p.addr, p.poll, p.adopted = fd, bound, poll, adopted
	return nil
}

func (p *Proxy) listenOrAdopt(addr netip.AddrPort) (fd int, bound netip.AddrPort, adopted bool, err error) {
	if p.cfg.Adopt != nil && addr.Port() != 0 {
		if fd, ok := p.cfg.Adopt(addr); ok {
			fd, bound, err = adoptUDP(fd, addr)
			return fd, bound, true, err
		}
	}
	fd, bound, err = listenUDP(addr, p.cfg.FreeBind)
	return fd, bound, false, err
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
	case !p.addr.IsValid():
		p.mu.Unlock()
		return fmt.Errorf("udp %s: run: not listening", p.name)
	case p.running:
		p.mu.Unlock()
		return fmt.Errorf("udp %s: run: already running", p.name)
	}
	p.running = true
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
	err := p.serve()
	close(stop)
	wg.Wait()
	p.Close()
	p.mu.Lock()
	p.running = false
	if p.poll != nil {
		p.poll.close()
		p.poll = nil
	}
	p.mu.Unlock()
	return err
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
			p.expire()
			t.Reset(interval)
		}
	}
}

// sweepInterval sets how late past its timeout a session may end: a quarter of the timeout,
// between 10 ms and 1 s.
func sweepInterval(timeout time.Duration) time.Duration {
	return min(max(timeout/4, 10*time.Millisecond), time.Second)
}

// Close closes the listening socket and every session. It is safe to call more than once and
// concurrently with Run, which then returns.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.stopped)
	p.markDrained()
	var errs []error
	for _, s := range p.sessions {
		p.end(s, flow.Shutdown)
	}
	if p.lfd >= 0 {
		if err := closeFD(p.lfd); err != nil {
			errs = append(errs, err)
		}
		p.lfd = -1
	}
	switch {
	case p.poll == nil:
	case p.running:
		p.poll.wake() // Run's loop sees closed and releases the poller
	default:
		if err := p.poll.close(); err != nil {
			errs = append(errs, err)
		}
		p.poll = nil
	}
	ended := p.takeEnded()
	p.mu.Unlock()
	p.report(ended)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("udp %s: close: %w", p.name, err)
	}
	return nil
}

// SetRefusing closes the listening socket (on) or opens it again on the same address (off), while
// the proxy stays. With no socket bound to its address the kernel answers a datagram with ICMP
// port unreachable, so a client learns at once that nobody serves it (ECONNREFUSED on a connected
// socket), as the portal rules refuse a service port without endpoints in iptables mode. Closing
// ends every session. For bind portal mode, where the socket listens on the service address
// itself. It fails if the address cannot be bound again; after Close it does nothing.
func (p *Proxy) SetRefusing(on bool) error {
	p.mu.Lock()
	if p.closed || p.released || !p.addr.IsValid() || on == (p.lfd < 0) {
		p.mu.Unlock()
		return nil
	}
	var err error
	if on {
		for _, s := range p.sessions {
			p.end(s, flow.Shutdown)
		}
		err = closeFD(p.lfd) // closing also takes it out of the epoll set
		p.lfd = -1
	} else {
		err = p.relisten()
	}
	ended := p.takeEnded()
	p.mu.Unlock()
	p.report(ended)
	if err != nil {
		return fmt.Errorf("udp %s: refusing=%t: %w", p.name, on, err)
	}
	return nil
}

// relisten binds the listening socket again on its address. Called with mu held.
func (p *Proxy) relisten() error {
	fd, _, err := listenUDP(p.addr, p.cfg.FreeBind)
	if err != nil {
		return fmt.Errorf("listen again on %s: %w", p.addr, err)
	}
	if p.poll != nil {
		if err := p.poll.add(fd); err != nil {
			closeFD(fd)
			return err
		}
	}
	p.lfd = fd
	return nil
}

// Release stops reading client datagrams, so that a successor holding the same socket (a
// hand-over) gets every new one, and keeps the sessions that may still carry a reply: their
// replies still leave through the socket, so conntrack un-NATs them. A session whose client's last
// datagram was answered ends once quiet for releasedQuiet (a second), one still waiting for its
// reply at its idle timeout as before (a resolver's answer after a 5 s upstream timeout still
// arrives). So the old process of a hand-over exits as soon as the replies it owes are out, not at
// its drain deadline because clients are idle. Drained is closed once no session is left; Close
// ends them at once.
func (p *Proxy) Release() {
	p.mu.Lock()
	if p.closed || p.released {
		p.mu.Unlock()
		return
	}
	p.released = true
	if p.lfd >= 0 && p.poll != nil {
		if err := p.poll.remove(p.lfd); err != nil {
			p.log.WithError(err).Warn("Cannot stop reading client datagrams")
		}
	}
	p.endAnswered()
	p.checkDrained()
	ended := p.takeEnded()
	p.mu.Unlock()
	p.report(ended)
}

// DefaultReleasedQuiet is how long a released proxy keeps an answered session without traffic: a
// reply in several datagrams, or a second reply to one request, still finds it.
const DefaultReleasedQuiet = time.Second

// releasedQuiet is DefaultReleasedQuiet, or the idle timeout when that is shorter.
func releasedQuiet(idle time.Duration) time.Duration { return min(idle, DefaultReleasedQuiet) }

// Drained is closed once the proxy is released with no session left, or closed.
func (p *Proxy) Drained() <-chan struct{} { return p.drained }

// checkDrained closes drained if the proxy is released and no session is live. Called with mu
// held, after a session ended.
func (p *Proxy) checkDrained() {
	if !p.released {
		return
	}
	for _, s := range p.sessions {
		if s.fd >= 0 {
			return
		}
	}
	p.markDrained()
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
	p.mu.Lock()
	n := 0
	for _, s := range p.sessions {
		if s.endpoint == ep && s.fd >= 0 {
			p.end(s, reason)
			n++
		}
	}
	ended := p.takeEnded()
	p.mu.Unlock()
	p.report(ended)
	return n
}

// Stats returns the counters. It takes no lock.
func (p *Proxy) Stats() flow.Stats { return p.stats.snapshot() }

// Live is a snapshot of the live sessions, oldest first.
func (p *Proxy) Live() []flow.Info {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]flow.Info, 0, len(p.sessions))
	for s := p.lru.back; s != nil; s = s.lruPrev {
		if s.fd >= 0 {
			out = append(out, s.info(s.lastActive, flow.Unknown))
		}
	}
	slices.SortStableFunc(out, func(a, b flow.Info) int { return a.Start.Compare(b.Start) })
	return out
}

func (p *Proxy) takeEnded() []flow.Info {
	e := p.ended
	p.ended = nil
	return e
}

func (p *Proxy) report(ended []flow.Info) {
	if p.cfg.OnEnd == nil {
		return
	}
	for _, info := range ended {
		p.cfg.OnEnd(info)
	}
}
