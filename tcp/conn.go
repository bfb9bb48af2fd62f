package tcp

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// Observer is implemented by a Picker that wants to hear how its picks turned out (the
// balancer's least-connections counts and outlier detection). Every pick gets exactly one
// DialDone with an error, or one FlowDone: DialDone(ep, nil) when the dial connected (FlowDone
// follows when the connection ends), DialDone(ep, err) when the endpoint failed the dial, and
// FlowDone(ep, false) for a dial given up for the proxy's own reasons (shutdown, no descriptors).
// FlowDone's reset marks a connection the endpoint reset before sending anything.
type Observer interface {
	DialDone(ep netip.AddrPort, err error)
	FlowDone(ep netip.AddrPort, reset bool)
}

// conn is one accepted client connection and, once dialed, its endpoint connection. Its control
// (the dial ladder, accounting, termination) is shared by the engines; client, backend, dialing
// and the directions are the epoll engine's, u the io_uring engine's (nil on epoll).
type conn struct {
	p          *Proxy
	id         uint64
	u          *uconn
	client     *sock
	clientAddr netip.AddrPort
	start      int64        // unix nanoseconds on the proxy clock
	last       atomic.Int64 // last byte moved, unix nanoseconds on the proxy clock
	holding    atomic.Bool  // waiting for an endpoint (hold.go); the idle sweep skips it
	up, down   direction    // client->endpoint, endpoint->client

	mu       sync.Mutex
	backend  *sock
	dialing  *sock // the socket being connected, closed by terminate to abort the dial
	endpoint netip.AddrPort
	attempts int
	end      flow.EndReason
	err      error
	closed   bool // sockets closed (or closing); no direction may park or restart
	est      bool // the endpoint connection is established and the connection proxies
	live     int  // owners not yet released: the dialing goroutine, then one per direction
	eofs     int  // directions that saw FIN
	counted  bool // endpoint connected and reported to the Observer: finish reports the end
	drained  bool // drain deadline passed: both legs were sent FIN (see drain)

	fl *flowState // the flow's events, while Config.Flows is set (flows.go); nil otherwise
}

// newConn counts and tracks a new connection from peer, with one owner; u is its io_uring part
// (nil on epoll), set before the connection is visible to Shutdown and the others.
func (p *Proxy) newConn(peer netip.AddrPort, u *uconn) *conn {
	return p.initConn(new(conn), peer, u)
}

// initConn is newConn on a zero conn the caller allocated (with its uconn, in one allocation).
func (p *Proxy) initConn(c *conn, peer netip.AddrPort, u *uconn) *conn {
	now := p.cfg.Clock.Now().UnixNano()
	c.p, c.clientAddr, c.start, c.live, c.u = p, peer, now, 1, u
	if u != nil {
		u.c = c
	}
	c.last.Store(now)
	p.stats.total.Add(1)
	p.stats.active.Add(1)
	p.track(c)
	return c
}

// handle starts serving an accepted connection (fd, from peer) on its own goroutine (epoll).
func (p *Proxy) handle(fd int, peer netip.AddrPort) {
	c := p.newConn(peer, nil)
	c.startFlow(fd)
	c.client = newSock(fd)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		c.serve()
	}()
}

// serve dials an endpoint, then starts a goroutine for each direction and returns.
//
// Why not run client->endpoint on this goroutine: a dial that has to wait for its handshake (an
// endpoint on another node; see awaitConnect) goes down to the runtime poller's deadline timers, whose
// call chain outgrows a new goroutine's 2 KiB stack, so this goroutine ends with 4 KiB, while the
// directions' loops fit in 2 KiB (checked with debug.SetMaxStack). Until they
// park, the connections of a burst would each hold that 4 KiB stack, and the runtime returns freed
// stack memory to the OS only slowly. Exiting here frees it for the next dial at the cost of one
// goroutine start (bench/suite, 9,000 idle connections opened in a burst: 4.7-5.3 KiB RSS per
// connection before, 4.2-4.6 KiB after; no change in CPU per connection).
func (c *conn) serve() {
	be, reason, err := c.dial()
	if err != nil {
		c.fail(reason, err)
		c.release()
		return
	}
	if v := c.p.cfg.ProxyProtocol; v != proxyprotocol.Off {
		if err := c.sendProxyHeader(be, v); err != nil {
			be.resetOnClose()
			be.close()
			c.fail(flow.EndpointReset, fmt.Errorf("send the PROXY protocol header: %w", err))
			c.release()
			return
		}
	}
	if c.fl != nil {
		if c.p.watched() {
			_ = be.raw.Control(c.fl.source)
		}
		c.dialRecorded()
	}
	c.mu.Lock()
	if c.closed { // terminated (Shutdown, idle timeout) while dialing
		c.mu.Unlock()
		be.resetOnClose()
		be.close()
		c.release()
		return
	}
	c.backend, c.est = be, true
	c.up.init(c, true, c.client, be)
	c.down.init(c, false, be, c.client)
	c.live++ // endpoint->client; client->endpoint inherits the dialer's share
	c.mu.Unlock()
	c.p.goRun(&c.down)
	c.p.goRun(&c.up)
}

// dial walks the timeout ladder, asking the picker for a fresh endpoint (reset=true) after a failure
// of the endpoint (retryElsewhere).
func (c *conn) dial() (*sock, flow.EndReason, error) {
	p := c.p
	reset := false
	var lastErr error
	for i, timeout := range p.cfg.DialTimeouts {
		ep, err := c.next(reset)
		if err != nil {
			if i > 0 {
				break
			}
			var reason flow.EndReason
			if ep, reason, err = c.hold(err); err != nil {
				return nil, reason, err
			}
		}
		c.attempt(ep, i)
		// No bind before connect: bind(0.0.0.0:0)'s ephemeral port search dominated the profile
		// (86% of CPU at 3000 connections/s with many sockets in TIME_WAIT); connect() picks a
		// port far more cheaply.
		deadline := time.Now().Add(timeout) // the runtime poller's deadlines are on the real clock
		s, err := dialSock(ep, deadline, p.cfg.KeepAlive, c)
		if err != nil && outOfResources(err) {
			s, err = c.dialBackingOff(ep, deadline, err)
		}
		if err == nil {
			if c.fl != nil {
				c.connectedNow()
			}
			c.observed(ep, nil)
			return s, flow.Unknown, nil
		}
		var stop bool
		if lastErr, stop = c.attemptFailed(ep, i, timeout, err); stop {
			return nil, flow.Shutdown, err
		}
		reset = retryElsewhere(err)
	}
	return nil, flow.DialFailed, dialsFailed(lastErr)
}

// attemptFailed counts, logs and reports to the Observer a failed dial attempt (i) to ep. It
// returns the error naming the attempt, for the next one to carry; stop means the connection or
// the proxy is closing and the ladder must end.
func (c *conn) attemptFailed(ep netip.AddrPort, i int, timeout time.Duration, err error) (lastErr error, stop bool) {
	lastErr = c.dialFailed(ep, i, timeout, err)
	if lastErr == nil || outOfResources(err) {
		c.observed(ep, errNotEndpoints)
	} else {
		c.observed(ep, err)
	}
	return lastErr, lastErr == nil
}

// retryElsewhere reports whether the next attempt after one that failed with err should ask the
// picker for another endpoint (reset=true, which also moves a ClientIP-affinity client off its
// endpoint). Not when the proxy itself ran out of descriptors or kernel memory (EMFILE, ENFILE,
// ENOBUFS, ENOMEM) through the attempt's back-off: that says nothing about the endpoint, so the
// next attempt goes to the same pick again, after the back-off it already waited, and a client
// with affinity keeps its endpoint. If the shortage outlasts the ladder the client is refused.
func retryElsewhere(err error) bool {
	return !outOfResources(err)
}

// errNotEndpoints stands for a dial that failed for the proxy's own reasons.
var errNotEndpoints = errors.New("dial abandoned by the proxy")

// observed tells the picker, if it listens, how a dial to ep ended.
func (c *conn) observed(ep netip.AddrPort, err error) {
	o, ok := c.p.picker.(Observer)
	switch {
	case !ok:
	case err == nil:
		c.mu.Lock()
		c.counted = true
		c.mu.Unlock()
		o.DialDone(ep, nil)
	case errors.Is(err, errNotEndpoints):
		o.FlowDone(ep, false)
	default:
		o.DialDone(ep, err)
	}
}

func (c *conn) attempt(ep netip.AddrPort, i int) {
	c.mu.Lock()
	c.endpoint = ep
	c.attempts++
	c.mu.Unlock()
	c.p.stats.dialAttempts.Add(1)
	if i > 0 {
		c.p.stats.dialRetries.Add(1)
	}
	if c.fl != nil {
		c.attempted(i)
	}
}

func (c *conn) noEndpoints(err error) error {
	c.p.stats.noEndpoints.Add(1)
	return fmt.Errorf("pick endpoint: %w", err)
}

// dialFailed counts and logs a failed attempt and returns its error, naming the endpoint; nil if
// the connection or the proxy is closing, and the ladder should stop (err then says so).
func (c *conn) dialFailed(ep netip.AddrPort, i int, timeout time.Duration, err error) error {
	c.p.stats.dialFailures.Add(1)
	if c.p.ctx.Err() != nil || c.isClosed() {
		return nil
	}
	err = fmt.Errorf("dial endpoint %s (attempt %d, timeout %s): %w", ep, i+1, timeout, err)
	c.logger().WithError(err).Debug("dial failed, trying the next endpoint")
	return err
}

func dialsFailed(lastErr error) error {
	if lastErr == nil {
		lastErr = errors.New("no endpoint to retry")
	}
	return fmt.Errorf("connect to an endpoint: %w", lastErr)
}

// dialBackingOff retries a dial that failed for want of descriptors (or kernel memory). That says
// nothing about ep, so instead of failing over it backs off and tries ep again while the attempt's
// time lasts; closing connections free what it needs. (The accept loop backs off the same way,
// but it can only see the limit when accept itself fails; a connection accepted with the last
// free descriptor meets it here.)
func (c *conn) dialBackingOff(ep netip.AddrPort, deadline time.Time, err error) (*sock, error) {
	backoff := time.Duration(0)
	for outOfResources(err) {
		backoff = nextBackoff(backoff)
		if time.Until(deadline) < backoff {
			break
		}
		if backoff == minBackoff { // once per attempt, not per retry
			c.logger().WithError(err).Warn("dial: out of resources, backing off")
		}
		if !c.p.sleep(backoff) {
			break
		}
		var s *sock
		if s, err = dialSock(ep, deadline, c.p.cfg.KeepAlive, c); err == nil {
			return s, nil
		}
	}
	return nil, err
}

// startDial records the socket being connected so that terminate can abort the dial; false if the
// connection is already closed.
func (c *conn) startDial(s *sock) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.dialing = s
	return true
}

// endDial forgets the socket of a dial that ended.
func (c *conn) endDial() {
	c.mu.Lock()
	c.dialing = nil
	c.mu.Unlock()
}

func (c *conn) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

func (c *conn) logger() logrus.FieldLogger {
	c.mu.Lock()
	ep := c.endpoint
	c.mu.Unlock()
	l := c.p.logger().WithField("client", c.clientAddr.String())
	if ep.IsValid() {
		l = l.WithField("endpoint", ep.String())
	}
	return l
}

func (c *conn) endpointAddr() netip.AddrPort {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.est {
		return netip.AddrPort{}
	}
	return c.endpoint
}

// fail records err and resets both legs.
func (c *conn) fail(reason flow.EndReason, err error) {
	c.mu.Lock()
	if c.err == nil && !c.closed {
		c.err = err
	}
	c.mu.Unlock()
	if !c.terminate(reason, true) {
		return
	}
	l := c.logger().WithError(err).WithField("reason", reason.String())
	switch reason {
	case flow.DialFailed:
		l.Warn("no endpoint reachable, reset client")
	case flow.NoEndpoints:
		l.Debug("no endpoints, reset client")
	default:
		l.Debug("connection reset")
	}
}

// terminate closes both sockets, with a reset when rst is set (SO_LINGER 0: the kernel sends RST and
// drops unsent data). It reports false if the connection was already closing. Parked directions have
// no goroutine to notice, so they are released here.
func (c *conn) terminate(reason flow.EndReason, rst bool) bool {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return false
	}
	c.closed = true
	// A drained connection ends for its drain deadline, whatever finishes it (a peer's FIN, the
	// reset after the grace, a write to a leg that was shut down).
	if !c.drained && (c.end == flow.Unknown || (reason != flow.ClientClosed && reason != flow.EndpointClosed)) {
		c.end = reason
	}
	for _, d := range []*direction{&c.up, &c.down} {
		if d.parked {
			d.parked = false
			c.live--
		}
	}
	be, dialing, done := c.backend, c.dialing, c.live == 0
	c.mu.Unlock()
	if c.u != nil {
		c.u.terminate(rst) // the loop closes the sockets, then releases its share
		if done {
			c.finish()
		}
		return true
	}
	if rst {
		c.client.resetOnClose()
		if be != nil {
			be.resetOnClose()
		}
	}
	c.client.close()
	if be != nil {
		be.close()
	}
	if dialing != nil {
		dialing.close() // its dialer wakes up, sees closed, and gives up
	}
	if done {
		c.finish()
	}
	return true
}

// release drops one owner; the last one out closes the sockets (if nobody did) and finishes.
func (c *conn) release() {
	c.mu.Lock()
	c.live--
	done, closed := c.live == 0, c.closed
	c.mu.Unlock()
	if !done {
		return
	}
	if !closed {
		c.terminate(flow.Unknown, false) // finishes, since live is 0
		return
	}
	c.finish()
}

// finish runs once, after the last owner is gone and the sockets are closed.
func (c *conn) finish() {
	if c.u == nil {
		c.up.releasePipe()
		c.down.releasePipe()
		pk := c.p.parker.Load()
		pk.forget(&c.up)
		pk.forget(&c.down)
	}
	c.p.untrack(c)
	c.mu.Lock()
	end, counted, ep := c.end, c.counted, c.endpoint
	c.mu.Unlock()
	c.p.stats.ended[end].Add(1)
	c.p.stats.active.Add(-1)
	if o, ok := c.p.picker.(Observer); ok && counted {
		o.FlowDone(ep, end == flow.EndpointReset && c.down.bytes.Load() == 0)
	}
	if c.p.cfg.OnEnd == nil && c.fl == nil {
		return
	}
	info := c.info()
	if c.p.cfg.OnEnd != nil {
		c.p.cfg.OnEnd(info)
	}
	if c.fl != nil {
		c.endFlow(info)
	}
}

// drain starts the end of an established connection whose endpoint's drain deadline passed: FIN
// to both peers (shutdown for writing), so each reads EOF after what is in flight and can close
// cleanly; the directions keep forwarding what the peers still send. It reports false if the
// connection is closing, was drained already, or has no endpoint connection yet.
func (c *conn) drain() bool {
	c.mu.Lock()
	if c.closed || c.drained || !c.est {
		c.mu.Unlock()
		return false
	}
	c.drained = true
	c.end = flow.DrainTimeout
	be := c.backend
	c.mu.Unlock()
	if c.u != nil {
		c.u.drain()
		return true
	}
	// Errors (a peer already gone) are left to the directions, which see them on their sockets.
	_ = c.client.closeWrite()
	_ = be.closeWrite()
	return true
}

// isDrained reports whether drain sent this connection's FINs and it is still open.
func (c *conn) isDrained() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.drained && !c.closed
}

func (c *conn) info() flow.Info {
	now := c.p.cfg.Clock.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	start := time.Unix(0, c.start)
	return flow.Info{
		Client: c.clientAddr, Endpoint: c.endpoint,
		BytesToEndpoint: uint64(c.up.bytes.Load()), BytesToClient: uint64(c.down.bytes.Load()),
		Start: start, LastActive: time.Unix(0, c.last.Load()), Duration: now.Sub(start),
		DialAttempts: c.attempts, End: c.endIfClosed(), Err: c.err,
	}
}

func (c *conn) endIfClosed() flow.EndReason {
	if !c.closed {
		return flow.Unknown
	}
	return c.end
}
