package tcp

// The epoll engine's connections: the transport of a connection on the Go runtime poller. A
// goroutine dials (the ladder of conn.go's rules, blocking on the poller), then one goroutine per
// direction moves the bytes (splice.go) until it parks (park.go).

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// epollConn is the epoll engine's side of a connection (transport): its sockets and directions.
type epollConn struct {
	c        *conn
	client   *sock
	up, down direction // client->endpoint, endpoint->client

	// guarded by c.mu
	backend *sock
	dialing *sock // the socket being connected, closed by terminate to abort the dial
	// what terminate closes, taken with the connection marked closed (closingLocked): the endpoint
	// socket and a dial in flight
	closeBackend, closeDialing *sock
}

var _ transport = (*epollConn)(nil)

// connAndEpoll is a connection on the epoll engine: both parts live and die together, in one
// allocation.
type connAndEpoll struct {
	c conn
	e epollConn
}

// handle starts serving an accepted connection (fd, from peer) on its own goroutine.
func (p *Proxy) handle(fd int, peer netip.AddrPort) {
	both := new(connAndEpoll)
	e := &both.e
	// Linked before initConn makes the connection visible (Shutdown may terminate it at once).
	e.c, e.client = &both.c, newSock(fd)
	p.initConn(e.c, peer, e)
	e.c.startFlow(fd)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		e.serve()
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
func (e *epollConn) serve() {
	c := e.c
	be, reason, err := e.dial()
	if err != nil {
		c.fail(reason, err)
		c.release()
		return
	}
	if v := c.p.cfg.ProxyProtocol; v != proxyprotocol.Off {
		if err := e.sendProxyHeader(be, v); err != nil {
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
	e.backend, c.est = be, true
	e.up.init(c, true, e.client, be)
	e.down.init(c, false, be, e.client)
	c.live++ // endpoint->client; client->endpoint inherits the dialer's share
	c.mu.Unlock()
	c.p.goRun(&e.down)
	c.p.goRun(&e.up)
}

// dial walks the timeout ladder, asking the picker for a fresh endpoint (reset=true) after a failure
// of the endpoint (retryElsewhere).
func (e *epollConn) dial() (*sock, flow.EndReason, error) {
	c := e.c
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
		// port far more cheaply. (A transparent dial binds the client's port: no search.)
		deadline := time.Now().Add(timeout) // the runtime poller's deadlines are on the real clock
		s, err := e.dialFrom(ep, deadline)
		if err != nil && outOfResources(err) {
			s, err = e.dialBackingOff(ep, deadline, err)
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

// dialBackingOff retries a dial that failed for want of descriptors (or kernel memory). That says
// nothing about ep, so instead of failing over it backs off and tries ep again while the attempt's
// time lasts; closing connections free what it needs. (The accept loop backs off the same way,
// but it can only see the limit when accept itself fails; a connection accepted with the last
// free descriptor meets it here.)
func (e *epollConn) dialBackingOff(ep netip.AddrPort, deadline time.Time, err error) (*sock, error) {
	c := e.c
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
		if s, err = e.dialFrom(ep, deadline); err == nil {
			return s, nil
		}
	}
	return nil, err
}

// dialFrom dials ep from the client's address if the policy says so (dialSource), else, or if
// that address cannot be taken, from the proxy's.
func (e *epollConn) dialFrom(ep netip.AddrPort, deadline time.Time) (*sock, error) {
	c := e.c
	src := c.dialSource(ep)
	s, err := dialSock(ep, src, deadline, c.p.cfg.KeepAlive, e)
	if !src.IsValid() {
		return s, err
	}
	if errors.Is(err, errSourceTaken) {
		c.sourceFailed(src, ep, err)
		return dialSock(ep, netip.AddrPort{}, deadline, c.p.cfg.KeepAlive, e)
	}
	if err == nil {
		c.p.stats.transparentDials.Add(1)
	}
	return s, err
}

// startDial records the socket being connected so that terminate can abort the dial; false if the
// connection is already closed.
func (e *epollConn) startDial(s *sock) bool {
	c := e.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	e.dialing = s
	return true
}

// endDial forgets the socket of a dial that ended.
func (e *epollConn) endDial() {
	e.c.mu.Lock()
	e.dialing = nil
	e.c.mu.Unlock()
}

// sendProxyHeader writes the PROXY protocol header on the endpoint socket, in one write, before
// either direction starts, so the header is the first thing the endpoint reads and the splice
// path stays as it is. The socket has just connected and its send buffer is empty, so the write
// of at most 107 bytes completes at once; a partial write is finished all the same.
func (e *epollConn) sendProxyHeader(be *sock, v proxyprotocol.Version) error {
	var buf [proxyprotocol.MaxLen]byte
	var b []byte
	_ = e.client.raw.Control(func(fd uintptr) { b = e.c.proxyHeader(buf[:0], int(fd), v) })
	var werr error
	err := be.raw.Write(func(fd uintptr) bool {
		for len(b) > 0 {
			n, err := sysWrite(int(fd), b)
			switch err {
			case nil:
				b = b[n:]
			case unix.EINTR:
			case unix.EAGAIN:
				return false
			default:
				werr = os.NewSyscallError("write", err)
				return true
			}
		}
		return true
	})
	if err != nil {
		return err
	}
	return werr
}

// closingLocked releases the parked directions: they have no goroutine to notice the close. It takes
// what terminate closes while c.mu is held: after it, a dial only ends (endDial), and a dial
// that connects finds the connection closed and closes its socket itself (serve).
func (e *epollConn) closingLocked() (released int) {
	for _, d := range []*direction{&e.up, &e.down} {
		if d.parked {
			d.parked = false
			released++
		}
	}
	e.closeBackend, e.closeDialing = e.backend, e.dialing
	return released
}

// terminate closes the sockets: the directions' goroutines wake up with an error, and a dialer
// sees the connection closed and gives up.
func (e *epollConn) terminate(rst bool) {
	be, dialing := e.closeBackend, e.closeDialing
	if rst {
		e.client.resetOnClose()
		if be != nil {
			be.resetOnClose()
		}
	}
	e.client.close()
	if be != nil {
		be.close()
	}
	if dialing != nil {
		dialing.close() // its dialer wakes up, sees closed, and gives up
	}
}

// drain sends FIN to both peers; the connection is established, so backend is set for good.
func (e *epollConn) drain() {
	_ = e.client.closeWrite()
	_ = e.backend.closeWrite()
}

// finished gives back the directions' buffers and pipes and forgets their idle watch.
func (e *epollConn) finished() {
	e.up.releasePipe()
	e.down.releasePipe()
	pk := e.c.p.parker.Load()
	pk.forget(&e.up)
	pk.forget(&e.down)
}

// watchHeld watches a held connection's client socket in the runtime poller until stop is
// called. The bytes a client sends are left in the socket for the endpoint; each arrival only
// wakes the watch. stop ends the watch (through an expired read deadline, cleared again
// afterwards) and waits for it, so the socket is the dialer's again.
func (e *epollConn) watchHeld() (gone <-chan flow.EndReason, stop func()) {
	ch := make(chan flow.EndReason, 1)
	var stopping atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		// The error is the expired deadline of stop, or a socket closed by terminate: both
		// mean the hold is over.
		_ = e.client.raw.Read(func(fd uintptr) bool {
			if stopping.Load() {
				return true
			}
			if reason, ok := clientGone(int(fd)); ok {
				ch <- reason
				return true
			}
			return false
		})
	}()
	return ch, func() {
		stopping.Store(true)
		_ = e.client.f.SetReadDeadline(time.Unix(1, 0))
		<-done
		_ = e.client.f.SetReadDeadline(time.Time{})
	}
}

// legs returns the sockets' descriptors. The caller holds c.mu (backend).
func (e *epollConn) legs() (client, endpoint int) {
	fd := func(s *sock) int {
		n := -1
		if s != nil {
			_ = s.raw.Control(func(f uintptr) { n = int(f) })
		}
		return n
	}
	return fd(e.client), fd(e.backend)
}
