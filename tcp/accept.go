package tcp

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"time"
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
	for {
		if err := p.ln.raw.Read(accept); err != nil {
			select {
			case <-p.closed: // Close closed the listener: this is the error it caused
				return nil
			default: // the listener itself is broken; retrying would spin
				return fmt.Errorf("tcp proxy %s: wait for connections: %w", p.name, err)
			}
		}
		if aerr == nil {
			backoff = 0
			p.handle(fd, peer)
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
	case <-p.closed:
		return false
	}
}
