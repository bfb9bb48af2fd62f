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
// (the dial ladder's rules, accounting, termination) is the same on both engines; its sockets
// and the waiting on them are its transport's, the engine's side of the connection.
type conn struct {
	p          *Proxy
	id         uint64
	t          transport // epollConn (epoll_conn.go) or uconn (uring_conn.go)
	clientAddr netip.AddrPort
	start      int64        // unix nanoseconds on the proxy clock
	last       atomic.Int64 // last byte moved, unix nanoseconds on the proxy clock
	holding    atomic.Bool  // waiting for an endpoint (hold.go); the idle sweep skips it
	// bytes moved client->endpoint (up) and endpoint->client (down): count
	bytesUp, bytesDown atomic.Int64

	mu       sync.Mutex
	endpoint netip.AddrPort
	attempts int
	end      flow.EndReason
	err      error
	closed   bool // sockets closed (or closing); no direction may park or restart
	est      bool // the endpoint connection is established and the connection proxies
	live     int  // owners not yet released: the engine's (epoll: the dialer, then one per direction)
	eofs     int  // directions that saw FIN
	counted  bool // endpoint connected and reported to the Observer: finish reports the end
	drained  bool // drain deadline passed: both legs were sent FIN (see drain)
	// transparentLeg: the endpoint connection was dialed from the client's address (Info).
	transparentLeg bool

	// noTransparent: a dial from the client's address failed locally, later attempts dial from
	// the proxy's (dialSource). The dialer's own, not under mu.
	noTransparent bool

	fl *flowState // the flow's events, while Config.Flows is set (flows.go); nil otherwise
}

// transport is the engine's side of one connection: its two sockets and the waiting on them
// (for the dial, for bytes, for a held client). The control in conn.go and hold.go asks these of
// it, from any goroutine unless it says otherwise; the engine drives the rest (the dial ladder,
// the directions) and calls back into the control. Implemented by epollConn (epoll_conn.go: the
// Go runtime poller, a goroutine per dial and per active direction) and uconn (uring_conn.go:
// a connection on an io_uring loop).
type transport interface {
	// closingLocked runs as terminate marks the connection closed, with c.mu held: it returns how
	// many of the connection's owners have no goroutine to see the sockets close and are
	// released now (epoll: its parked directions).
	closingLocked() (released int)
	// terminate closes both sockets, with a reset when rst (SO_LINGER 0: the kernel sends RST
	// and drops unsent data), and aborts a dial in flight. It does not wait: the owners still
	// running see their sockets closed and release their shares (conn.release).
	terminate(rst bool)
	// drain sends FIN to both peers (shutdown for writing) of an established connection;
	// errors (a peer already gone) are left to the directions, which see them on their sockets.
	drain()
	// finished frees what the engine keeps for the connection beyond its sockets (pipes, an
	// idle watch); once, after the last owner is gone (conn.finish).
	finished()
	// watchHeld watches the client socket of a connection held for an endpoint (hold.go), and
	// sends on gone why the client is gone, once it reset the connection or closed it without
	// having sent a byte (clientGone). stop ends the watch; the socket is the dialer's again
	// once it returns or, on a loop, before the loop handles the hold's result.
	watchHeld() (gone <-chan flow.EndReason, stop func())
	// legs returns the descriptors of the client and endpoint sockets, -1 for none (tests).
	legs() (client, endpoint int)
}

// initConn counts and tracks a new connection from peer on transport t, with one owner. The
// engine allocates c with its transport (one allocation for both) and links t to c before the
// connection is visible to Shutdown and the others.
func (p *Proxy) initConn(c *conn, peer netip.AddrPort, t transport) {
	now := p.cfg.Clock.Now().UnixNano()
	c.p, c.clientAddr, c.start, c.live, c.t = p, peer, now, 1, t
	c.last.Store(now)
	p.count().total.Add(1)
	p.count().active.Add(1)
	p.track(c)
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
	c.p.count().dialAttempts.Add(1)
	if i > 0 {
		c.p.count().dialRetries.Add(1)
	}
	if c.fl != nil {
		c.attempted(i)
	}
}

func (c *conn) noEndpoints(err error) error {
	c.p.count().noEndpoints.Add(1)
	return fmt.Errorf("pick endpoint: %w", err)
}

// dialFailed counts and logs a failed attempt and returns its error, naming the endpoint; nil if
// the connection or the proxy is closing, and the ladder should stop (err then says so).
func (c *conn) dialFailed(ep netip.AddrPort, i int, timeout time.Duration, err error) error {
	c.p.count().dialFailures.Add(1)
	if c.p.shut.fired() || c.isClosed() {
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

// terminate marks the connection closed and has its transport close both sockets, with a reset
// when rst is set. It reports false if the connection was already closing.
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
	c.live -= c.t.closingLocked()
	done := c.live == 0
	c.mu.Unlock()
	c.t.terminate(rst)
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
	c.t.finished()
	c.p.untrack(c)
	c.mu.Lock()
	end, counted, ep := c.end, c.counted, c.endpoint
	c.mu.Unlock()
	c.p.count().ended[end].Add(1)
	c.p.count().active.Add(-1)
	if o, ok := c.p.picker.(Observer); ok && counted {
		o.FlowDone(ep, end == flow.EndpointReset && c.bytesDown.Load() == 0)
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
	c.mu.Unlock()
	c.t.drain()
	return true
}

// count counts n bytes a direction (up: client->endpoint) moved, at now (unix nanoseconds on
// the proxy clock): both engines' directions call it.
func (c *conn) count(up bool, n, now int64) {
	if up {
		c.bytesUp.Add(n)
		c.p.count().bytesIn.Add(n)
	} else {
		c.bytesDown.Add(n)
		c.p.count().bytesOut.Add(n)
	}
	c.last.Store(now)
}

// sawEOF records that a direction (up: client->endpoint) read EOF, and says whether its
// destination must be shut down for writing to forward the FIN (both engines).
func (c *conn) sawEOF(up bool) (shut bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.end == flow.Unknown { // before the shutdown: the peer may answer our FIN with its own at once
		c.end = flow.EndpointClosed
		if up {
			c.end = flow.ClientClosed
		}
	}
	// The other direction already ended: closing both sockets sends this FIN too, so the shutdown
	// would be a wasted syscall. Nothing is unread on either socket (both reads saw EOF), so the
	// close sends FIN, not RST. And drain shut both destinations down already; a second shutdown
	// may fail (ENOTCONN once the peer's FIN completed the close) and would be taken for a broken leg.
	return c.eofs != 1 && !c.drained
}

// eofForwarded counts a direction that forwarded its EOF; the second one ends the connection.
func (c *conn) eofForwarded() {
	c.mu.Lock()
	c.eofs++
	both, end := c.eofs == 2, c.end
	c.mu.Unlock()
	if both {
		c.terminate(end, false)
	}
}

// legFailed resets the connection after a read (onWrite=false) or write error of a direction (up:
// client->endpoint), with the reason naming the side that failed (both engines).
func (c *conn) legFailed(up, onWrite bool, err error) {
	if c.isClosed() {
		return
	}
	op := "read"
	if onWrite {
		op = "write"
	}
	dir := "endpoint->client"
	if up {
		dir = "client->endpoint"
	}
	clientSide := up != onWrite // reading client->endpoint, or writing endpoint->client
	reason := flow.EndpointReset
	if clientSide {
		reason = flow.ClientReset
	}
	c.fail(reason, fmt.Errorf("%s: %s: %w", dir, op, err))
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
		BytesToEndpoint: uint64(c.bytesUp.Load()), BytesToClient: uint64(c.bytesDown.Load()),
		Start: start, LastActive: time.Unix(0, c.last.Load()), Duration: now.Sub(start),
		DialAttempts: c.attempts, End: c.endIfClosed(), Err: c.err, Transparent: c.transparentLeg,
	}
}

// dialedTransparently records a dial from the client's address that connected: counted, and
// shown in the flow's Info (the access log says what the endpoint saw).
func (c *conn) dialedTransparently() {
	c.p.count().transparentDials.Add(1)
	c.mu.Lock()
	c.transparentLeg = true
	c.mu.Unlock()
}

func (c *conn) endIfClosed() flow.EndReason {
	if !c.closed {
		return flow.Unknown
	}
	return c.end
}
