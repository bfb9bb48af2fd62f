package tcp

import (
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// DefaultHoldLimit bounds how many connections one proxy socket holds at once while its service
// port has no endpoint (Config.HoldLimit 0). Each costs its client socket and a goroutine waiting
// (about 5 KiB), so the limit keeps a client that opens connections in a loop from eating the
// node's descriptors; past it, new connections are reset as without a hold.
const DefaultHoldLimit = 1024

// hold is called when the first pick of a connection found no endpoint (pickErr). Without a hold
// timeout it ends the connection as before: no endpoints. With one, the connection waits, its
// client socket open and unread, until WakeHeld says the endpoints changed and a pick succeeds,
// or until the timeout (HoldTimeout), and returns the endpoint to dial.
//
// The wake channel is taken before each pick, so an update that lands between a failed pick and
// the wait still wakes it. A held connection is not idle-swept: it has not started.
//
// The client socket is watched while held (watchHeldClient), so a client that gives up frees its
// place in the hold at once instead of at the hold timeout: a reset, or a FIN before any byte,
// ends the hold (HoldClientGone). A FIN after the client sent bytes is kept: it cannot be told from
// a half-close (a request, then shutdown(SHUT_WR), then waiting for the answer), which must reach
// the endpoint like any other; the hold's time and count bounds keep what such clients cost in check.
func (c *conn) hold(pickErr error) (netip.AddrPort, flow.EndReason, error) {
	p := c.p
	timeout := p.cfg.HoldTimeout
	if timeout <= 0 {
		return netip.AddrPort{}, flow.NoEndpoints, c.noEndpoints(pickErr)
	}
	if p.count().held.Add(1) > int64(p.cfg.HoldLimit) {
		p.count().held.Add(-1)
		p.count().holds[flow.HoldFull].Add(1)
		return netip.AddrPort{}, flow.NoEndpoints, c.noEndpoints(fmt.Errorf("%d connections held already: %w", p.cfg.HoldLimit, pickErr))
	}
	c.holding.Store(true)
	if c.fl != nil {
		c.fl.held = true
		c.record(flow.PhaseHeld)
	}
	defer func() {
		c.holding.Store(false)
		c.last.Store(p.cfg.Clock.Now().UnixNano()) // the idle timeout counts from the end of the hold
		p.count().held.Add(-1)
	}()
	t := p.cfg.Clock.NewTimer(timeout)
	defer t.Stop()
	gone, stopWatch := c.watchHeldClient()
	defer stopWatch()
	for {
		wake := p.holdWake()
		ep, err := c.next(false)
		if err == nil {
			p.count().holds[flow.HoldServed].Add(1)
			return ep, flow.Unknown, nil
		}
		select {
		case <-wake:
			continue
		case <-t.C():
			p.count().holds[flow.HoldExpired].Add(1)
			return netip.AddrPort{}, flow.HoldTimeout, fmt.Errorf("no endpoint within the hold timeout %s: %w", timeout, err)
		case reason := <-gone:
			p.count().holds[flow.HoldClientGone].Add(1)
			return netip.AddrPort{}, reason, fmt.Errorf("held: the client gave up (%s) before an endpoint appeared: %w", reason, err)
		case <-p.shut.wait():
			p.count().holds[flow.HoldAborted].Add(1)
			return netip.AddrPort{}, flow.Shutdown, fmt.Errorf("held: %w", errClosed)
		case <-p.closed.wait():
			// The socket closed (its service port is gone or changed): one last pick, then the
			// client is reset and reconnects to whatever serves the port now.
			if ep, err = c.next(false); err == nil {
				p.count().holds[flow.HoldServed].Add(1)
				return ep, flow.Unknown, nil
			}
			p.count().holds[flow.HoldAborted].Add(1)
			return netip.AddrPort{}, flow.NoEndpoints, c.noEndpoints(fmt.Errorf("held, proxy socket closed: %w", err))
		}
	}
}

// holdWake returns the channel WakeHeld closes next. It is made on first use: a proxy that holds
// nothing pays nothing for WakeHeld.
func (p *Proxy) holdWake() <-chan struct{} {
	p.holdMu.Lock()
	defer p.holdMu.Unlock()
	if p.wake == nil {
		p.wake = make(chan struct{})
	}
	return p.wake
}

// WakeHeld tells the proxy its endpoints may have changed: every held connection picks again
// (and is dialed if it finds an endpoint). Cheap when nothing is held.
func (p *Proxy) WakeHeld() {
	p.holdMu.Lock()
	if p.wake != nil {
		close(p.wake)
		p.wake = nil
	}
	p.holdMu.Unlock()
}

// watchHeldClient watches a held connection's client socket until stop is called (the
// transport's watchHeld: the runtime poller on epoll, a poll on the connection's ring on
// io_uring), and sends on gone why the client is gone once it reset the connection (ClientReset)
// or closed it without having sent a byte (ClientClosed): nothing of it would reach the
// endpoint, and its place in the hold is free again.
func (c *conn) watchHeldClient() (gone <-chan flow.EndReason, stop func()) {
	return c.t.watchHeld()
}

// The kernel's TCP states (include/net/tcp_states.h) as TCP_INFO reports them.
const (
	tcpStateClose     = 7
	tcpStateCloseWait = 8
)

// clientGone reads a held client socket's TCP state without consuming anything: closed (a reset
// arrived) means gone; close-wait (a FIN arrived) with nothing queued means it gave up before
// sending a byte. A FIN after bytes may be a half-close waiting for its answer: not gone.
func clientGone(fd int) (flow.EndReason, bool) {
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return flow.Unknown, false // the dial will find out
	}
	switch info.State {
	case tcpStateClose:
		return flow.ClientReset, true
	case tcpStateCloseWait:
		queued, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
		if err == nil && queued == 0 {
			return flow.ClientClosed, true
		}
	}
	return flow.Unknown, false
}
