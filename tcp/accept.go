package tcp

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Back-off bounds when out of descriptors or memory (accept, and dial): the listener stays readable
// (the connection waits in the backlog), so retrying at once would spin a core. Back off
// exponentially instead; a closing connection frees descriptors and the next try succeeds.
const (
	minBackoff = 5 * time.Millisecond
	maxBackoff = time.Second
)

// nextBackoff doubles prev within the bounds; 0 starts at minBackoff.
func nextBackoff(prev time.Duration) time.Duration {
	return min(max(2*prev, minBackoff), maxBackoff)
}

// acceptLoop accepts until the listener is closed. It never dials: each connection gets its own
// goroutine, so a slow endpoint never delays the next client.
func (p *Proxy) acceptLoop() error {
	var (
		fd   int
		peer netip.AddrPort
		aerr error
	)
	accept := acceptFn(&fd, &peer, &aerr)
	backoff := time.Duration(0)
	// The listener is looked up again only when waiting on it fails (SetRefusing closed or
	// replaced it), so accepting takes no lock.
	ln, changed := p.listener()
	for {
		if ln == nil { // refusing: wait for SetRefusing(false) or Close
			select {
			case <-changed:
				ln, changed = p.listener()
				continue
			case <-p.closed.wait():
				return nil
			}
		}
		if err := ln.raw.Read(accept); err != nil {
			if p.closed.fired() { // Close closed the listener: this is the error it caused
				return nil
			}
			if next, ch := p.listener(); next != ln { // SetRefusing closed it
				ln, changed = next, ch
				continue
			}
			// The listener itself is broken; retrying would spin.
			return fmt.Errorf("tcp proxy %s: wait for connections: %w", p.name, err)
		}
		if aerr == nil {
			backoff = 0
			p.serveEpoll(fd, peer)
			continue
		}
		err := os.NewSyscallError("accept4", aerr)
		if !outOfResources(err) {
			// ECONNABORTED and friends concern one connection; the listener is fine.
			p.logger().WithError(err).Debug("accept failed")
			continue
		}
		backoff = nextBackoff(backoff)
		p.logger().WithError(err).WithField("backoff", backoff).Warn("accept: out of resources, backing off")
		if !p.sleep(backoff) {
			return nil
		}
	}
}

// deny resets a client that Config.Allow refused. The kernel completed its handshake before
// accept could see its address, so the client sees its connection reset rather than refused; it
// never reaches an endpoint.
func (p *Proxy) deny(fd int, peer netip.AddrPort) {
	// Counted and reported before the reset: a client (or a test) that has seen its reset must
	// find it in the metrics and the access log already.
	p.count().sourceDenied.Add(1)
	p.logger().WithField("client", peer.String()).Debug("client outside the allowed source ranges, reset")
	if p.cfg.OnEnd != nil || p.cfg.Flows != nil {
		now := p.cfg.Clock.Now()
		info := flow.Info{Client: peer, Start: now, LastActive: now, End: flow.SourceDenied}
		if p.cfg.OnEnd != nil {
			p.cfg.OnEnd(info)
		}
		if p.cfg.Flows != nil {
			p.recordDenied(fd, info)
		}
	}
	_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	_ = unix.Close(fd)
}

// listener returns the listening socket (nil while refusing) and the channel closed when it changes.
func (p *Proxy) listener() (*sock, <-chan struct{}) {
	p.lnMu.Lock()
	defer p.lnMu.Unlock()
	return p.ln, p.lnChanged.wait()
}

// SetRefusing closes the listening socket (on) or opens it again on the same address (off), while
// the proxy and its established connections stay. With nothing listening on its address the
// kernel answers a SYN with RST, so a client is refused at once (ECONNREFUSED), as the portal
// rules refuse a service port without endpoints in iptables mode; connections queued but not yet
// accepted are reset. For bind portal mode, where the socket listens on the service address
// itself. It fails if the address cannot be bound again; after Close it does nothing.
func (p *Proxy) SetRefusing(on bool) error {
	p.lnMu.Lock()
	defer p.lnMu.Unlock()
	if p.closed.fired() {
		return nil
	}
	if on == (p.ln == nil) {
		return nil
	}
	var old *sock
	if on {
		old, p.ln = p.ln, nil
	} else {
		ln, _, err := listenSock(p.addr, p.cfg.FreeBind, p.cfg.KeepAlive, p.engine().blockingListener())
		if err != nil {
			return fmt.Errorf("tcp proxy %s: listen again on %s: %w", p.name, p.addr, err)
		}
		p.ln = ln
	}
	p.lnChanged.renew()
	p.engine().listenerChanged(p)
	if old != nil {
		p.engine().stopAccepting(p, old)
		if err := old.close(); err != nil {
			return fmt.Errorf("tcp proxy %s: close listener: %w", p.name, err)
		}
	}
	return nil
}

// outOfResources is true for errors that will repeat until descriptors or memory are freed.
func outOfResources(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// sleep waits d on the proxy clock; false means the proxy was closed meanwhile.
func (p *Proxy) sleep(d time.Duration) bool {
	t := p.cfg.Clock.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-p.closed.wait():
		return false
	}
}
