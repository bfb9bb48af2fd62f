package tcp

import (
	"net/netip"
	"time"
)

// Spreading a busy port over several listening sockets (Config.AcceptLoops > 1).
//
// With one listener, every new connection of a port waits for the one accept goroutine to be
// scheduled: the runtime's netpoller readies it, and on a busy proxy it queues behind the
// goroutines of established connections. In bench/tcp's connection test the proxy's CPU was not
// the limit (it left CPU idle); latency was. A group of SO_REUSEPORT sockets on the same address,
// each with its own accept loop, lets the kernel spread the SYNs over them by hash, and the loops
// run in parallel (bench/RESULTS.md, 2026-11-23 issue 20: conn/s up, CPU per connection the same).
//
// The portal rules need no change: REDIRECT and DNAT lead to the port's address, and the kernel
// picks a socket of the group for each new connection. The group exists only when asked for:
// SO_REUSEPORT lets any socket of the same user bind the same address, so a port conflict with
// another of our sockets would no longer fail with EADDRINUSE.
//
// Extra sockets cost descriptors, so they are opened only when the port shows it needs them:
// spreadAfter connections in a row were already queued when the accept loop came back for them.
// An idle or lightly used service port keeps one descriptor. Once opened they stay until
// SetRefusing or Close closes the whole group; the next busy spell opens them again.

// spreadAfter is how many accepts in a row must find their connection already queued.
const spreadAfter = 4

// queueWatch counts, for the accept callback it wraps, whether each accept found its
// connection already queued (the callback ran once: no wait in the poller) or had to wait.
type queueWatch struct {
	calls  int // callback runs since the last accept returned
	queued int // accepts in a row that found a connection queued
}

func (q *queueWatch) wrap(accept func(uintptr) bool) func(uintptr) bool {
	return func(fd uintptr) bool {
		q.calls++
		return accept(fd)
	}
}

// streak is called after each accept and returns how many in a row found a queued connection.
func (q *queueWatch) streak() int {
	if q.calls == 1 {
		q.queued++
	} else {
		q.queued = 0
	}
	q.calls = 0
	return q.queued
}

// spread opens the extra listeners of ln's group, each with its own accept loop, unless they are
// open already or ln is no longer the listener (SetRefusing, Close). Failing to open one (out of
// descriptors) only means fewer loops.
func (p *Proxy) spread(ln *sock) {
	p.lnMu.Lock()
	defer p.lnMu.Unlock()
	if p.ln != ln || len(p.extra) > 0 {
		return
	}
	select {
	case <-p.closed:
		return
	default:
	}
	for range p.cfg.AcceptLoops - 1 {
		s, _, err := listenSock(p.addr, p.cfg.FreeBind, p.cfg.KeepAlive, true)
		if err != nil {
			p.logger().WithError(err).Debug("spread the port over another listener")
			break
		}
		p.extra = append(p.extra, s)
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.extraAcceptLoop(s)
		}()
	}
}

// closeExtraLocked closes the extra listeners (their loops then end); lnMu is held.
func (p *Proxy) closeExtraLocked() {
	for _, s := range p.extra {
		s.close()
	}
	p.extra = nil
}

// extraAcceptLoop accepts on one extra listener of the group until it is closed.
func (p *Proxy) extraAcceptLoop(ln *sock) {
	var (
		fd   int
		peer netip.AddrPort
		aerr error
	)
	accept := acceptFn(&fd, &peer, &aerr)
	backoff := time.Duration(0)
	for {
		if err := ln.raw.Read(accept); err != nil {
			return // closed by SetRefusing or Close
		}
		if !p.dispatch(fd, peer, aerr, &backoff) {
			return
		}
	}
}
