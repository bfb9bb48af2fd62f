package udp

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/loglevel"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// serve is the proxy loop: wait for ready sockets, then under mu read each ready session's replies
// into the outgoing batch and send them all from the listening socket with one sendmmsg, then read
// a batch of client datagrams and demultiplex them to their sessions.
func (p *shard) serve() error {
	for {
		ready, err := p.io.wait()
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil
		}
		if err != nil {
			p.mu.Unlock()
			return fmt.Errorf("udp %s: %w", p.name, err)
		}
		b := batchPool.Get().(*batch)
		now := p.cfg.Clock.Now()
		// Replies first: each one completes an exchange a client is waiting for, so they leave
		// before the pass spends time forwarding new requests.
		clients := false
		for _, fd := range ready {
			if int(fd) == p.lfd {
				clients = true
				continue
			}
			// A descriptor closed earlier in this pass is no longer in byFD; a reused one
			// belongs to its new session and at worst reads EAGAIN.
			if s := p.byFD[fd]; s != nil {
				p.readBackend(b, s, now)
			}
		}
		p.flush(b)
		if clients {
			p.readClients(b, now)
		}
		ended := p.takeEnded()
		p.mu.Unlock()
		batchPool.Put(b)
		p.report(ended)
	}
}

// Observer is implemented by a Picker that wants to hear how its picks turned out (the
// balancer's least-connections counts and outlier detection). Every pick gets DialDone(ep, nil)
// when its session opens and then FlowDone when the session ends (reset: the endpoint answered
// with ICMP port unreachable), or FlowDone(ep, false) at once if the session could not open.
type Observer interface {
	DialDone(ep netip.AddrPort, err error)
	FlowDone(ep netip.AddrPort, reset bool)
}

// readClients reads one batch from the listening socket. Level-triggered epoll reports the
// socket again if more is queued, so one busy client socket cannot starve the replies.
func (p *shard) readClients(b *batch, now time.Time) {
	got, err := p.io.recvBatch(p.lfd, &b.in, 0, p.cfg.BatchSize, true)
	if err != nil {
		if !temporary(err) {
			p.warn(now, "read from clients", err, nil)
		}
		return
	}
	for i := range got {
		if b.in.truncated(i) {
			p.stats.trunc.Add(1)
			continue
		}
		client, ok := sockopt.ParseRaw(&b.in.names[i])
		if !ok {
			continue
		}
		local, _ := b.in.local(i)
		p.forward(client, local, &b.in.names[i], b.in.hdrs[i].Hdr.Namelen, b.in.data(i), now)
	}
}

// forward sends one client datagram to the client's session, opening it if needed.
func (p *shard) forward(client netip.AddrPort, local netip.Addr, name *sockaddr, namelen uint32, data []byte, now time.Time) {
	s := p.sessions[client]
	if s == nil && p.cfg.Allow != nil && !p.cfg.Allow(client.Addr()) {
		p.deny(client, now)
		return
	}
	if s == nil || s.refused {
		if s = p.open(client, local, name, namelen, s != nil, now); s == nil {
			return
		}
	}
	err := p.io.send(s.fd, data)
	if errors.Is(err, unix.ECONNREFUSED) {
		// A pending ICMP port unreachable for an earlier datagram; this one was not sent. Re-pick
		// with affinity reset and try once more, so the client loses one datagram, not two.
		p.end(s, flow.EndpointRefused)
		if s = p.open(client, local, name, namelen, true, now); s == nil {
			return
		}
		err = p.io.send(s.fd, data)
	}
	if s.tap != nil && err == nil {
		s.tap.Payload(flow.ToEndpoint, now, data)
	}
	if err != nil {
		p.stats.toEndpoint.Add(1)
		if !temporary(err) && !errors.Is(err, unix.ECONNREFUSED) {
			p.warn(now, "send to endpoint", err, logrus.Fields{"client": client, "endpoint": s.endpoint})
		}
		return
	}
	s.setLocal(local)
	s.awaiting = true
	s.pktsTo++
	s.bytesTo += uint64(len(data))
	p.stats.pktsTo.Add(1)
	p.stats.bytesTo.Add(uint64(len(data)))
	p.touch(s, now)
}

// deny drops a datagram of a client that Config.Allow refused; it opens no session.
func (p *shard) deny(client netip.AddrPort, now time.Time) {
	p.stats.sourceDenied.Add(1)
	if p.debug() {
		p.log.WithField("client", client).Debug("client outside the allowed source ranges, datagram dropped")
	}
	p.refused(client, flow.SourceDenied, now)
}

// refused reports a datagram dropped before any session: to OnEnd and Flows, as an ended flow.
func (p *shard) refused(client netip.AddrPort, reason flow.EndReason, now time.Time) {
	if p.cfg.OnEnd == nil && p.cfg.Flows == nil {
		return
	}
	info := flow.Info{Client: client, Start: now, LastActive: now, End: reason}
	if p.cfg.OnEnd != nil {
		p.ended = append(p.ended, info)
	}
	if p.cfg.Flows != nil {
		p.record(flow.PhaseEnd, nil, info, now)
	}
}

// open picks an endpoint for client and opens a session to it, evicting the least recently used
// session when the table is full. It returns nil, having counted the drop, on failure.
func (p *shard) open(client netip.AddrPort, local netip.Addr, name *sockaddr, namelen uint32, reset bool, now time.Time) *session {
	ep, pick, err := p.next(client.Addr(), reset)
	if err != nil {
		p.stats.noEndpoint.Add(1)
		if p.cfg.Flows != nil {
			p.record(flow.PhaseEnd, nil, flow.Info{Client: client, Start: now, LastActive: now, End: flow.NoEndpoints}, now)
		}
		if p.debug() {
			p.log.WithFields(logrus.Fields{"client": client}).WithError(err).Debug("no endpoint, datagram dropped")
		}
		return nil
	}
	if old := p.sessions[client]; old != nil {
		p.end(old, flow.Unknown) // a refused session's tombstone; its end was already reported
	}
	for len(p.sessions) >= p.cfg.MaxSessions && p.lru.back != nil {
		p.end(p.lru.back, flow.Evicted)
	}
	var fd int
	var transparent bool
	if p.cfg.Source == nil {
		fd, err = dialUDP(ep, netip.AddrPort{})
	} else {
		fd, transparent, err = p.dialFrom(ep, p.dialSource(client, ep))
	}
	if err == nil {
		if err = p.io.add(fd); err != nil {
			closeFD(fd)
		}
	}
	o, observed := p.picker.(Observer)
	if err != nil {
		if observed { // a local socket failure, not the endpoint's
			o.FlowDone(ep, false)
		}
		p.stats.sessionSetup.Add(1)
		p.warn(now, "open session", err, logrus.Fields{"client": client, "endpoint": ep})
		return nil
	}
	if observed {
		o.DialDone(ep, nil)
	}
	s := &session{
		client: client, endpoint: ep, fd: fd,
		clientAddr: *name, clientAddrLen: namelen,
		started: now, lastActive: now, pick: pick, transparent: transparent,
	}
	p.sessions[client] = s
	p.byFD[int32(fd)] = s
	p.lru.pushFront(s)
	p.stats.created.Add(1)
	p.stats.active.Add(1)
	if p.cfg.Flows != nil {
		p.started(s, local, now)
	}
	if p.debug() {
		p.log.WithFields(logrus.Fields{"client": client, "endpoint": ep, "reset": reset}).Debug("session opened")
	}
	return s
}

// perSessionReads bounds the replies read from one session per pass.
const perSessionReads = 4

// readBackend reads a session's replies into the outgoing batch.
func (p *shard) readBackend(b *batch, s *session, now time.Time) {
	if b.outN == p.cfg.BatchSize {
		p.flush(b)
	}
	// A session rarely has more than one reply waiting; preparing a few slots, not the whole
	// batch, keeps a lone reply cheap. Level-triggered epoll reports the socket again if more wait.
	from := b.outN
	to := min(from+perSessionReads, p.cfg.BatchSize)
	got, err := p.io.recvBatch(s.fd, &b.out, from, to, false)
	switch {
	case err == nil:
	case temporary(err):
		return
	case errors.Is(err, unix.ECONNREFUSED):
		// ICMP port unreachable: nothing listens at the endpoint (any more).
		p.end(s, flow.EndpointRefused)
		return
	default:
		p.warn(now, "read from endpoint", err, logrus.Fields{"client": s.client, "endpoint": s.endpoint})
		p.end(s, flow.EndpointError)
		return
	}
	w := from
	for i := from; i < from+got; i++ {
		if b.out.truncated(i) {
			p.stats.trunc.Add(1)
			continue
		}
		b.out.move(i, w)
		b.out.addressReply(w, s)
		if s.tap != nil {
			s.tap.Payload(flow.ToClient, now, b.out.data(w))
		}
		s.pktsFrom++
		s.bytesFrom += uint64(b.out.hdrs[w].Len)
		w++
	}
	b.outN = w
	if got > 0 {
		s.awaiting = false
	}
	p.touch(s, now)
}

// flush sends the queued replies from the listening socket, so that conntrack maps their source
// back to the service address the client sent to.
func (p *shard) flush(b *batch) {
	hs := b.out.hdrs[:b.outN]
	for len(hs) > 0 {
		n, err := p.io.sendBatch(p.lfd, hs)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			// sendmmsg fails only for the first datagram (socket buffer full, unreachable
			// client): drop that one and send the rest.
			p.stats.toClient.Add(1)
			hs = hs[1:]
			continue
		}
		for _, h := range hs[:n] {
			p.stats.pktsFrom.Add(1)
			p.stats.bytesFrom.Add(uint64(h.Len))
		}
		hs = hs[n:]
	}
	b.outN = 0
}

// expire ends the sessions idle for IdleTimeout, oldest first.
func (p *shard) expire() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	deadline := p.cfg.Clock.Now().Add(-p.cfg.IdleTimeout)
	for s := p.lru.back; s != nil && !s.lastActive.After(deadline); s = p.lru.back {
		p.end(s, flow.IdleTimeout)
	}
	p.endAnswered()
	ended := p.takeEnded()
	p.mu.Unlock()
	p.report(ended)
}

// endAnswered ends, once the proxy is released, the sessions that wait for no reply and were quiet
// for releasedQuiet: no new datagram of their client reaches this process any more (the successor
// reads the socket), so they would only hold it open until the idle timeout. Called with mu held.
func (p *shard) endAnswered() {
	if !p.released {
		return
	}
	deadline := p.cfg.Clock.Now().Add(-releasedQuiet(p.cfg.IdleTimeout))
	for s := p.lru.back; s != nil; {
		prev := s.lruPrev
		if s.fd >= 0 && !s.awaiting && !s.lastActive.After(deadline) {
			p.end(s, flow.IdleTimeout)
		}
		s = prev
	}
}

// touch records traffic on s: its idle deadline slides and it becomes the last to be evicted.
func (p *shard) touch(s *session, now time.Time) {
	s.lastActive = now
	p.lru.moveToFront(s)
}

// end closes a session's backend socket and reports it once. A refused session stays in the table
// as a tombstone, so the client's next datagram re-picks with reset; any other end removes it.
func (p *shard) end(s *session, reason flow.EndReason) {
	if s.fd >= 0 {
		p.io.closeSocket(s.fd)
		delete(p.byFD, int32(s.fd))
		s.fd = -1
		p.stats.end(reason)
		if o, ok := p.picker.(Observer); ok {
			o.FlowDone(s.endpoint, reason == flow.EndpointRefused)
		}
		now := p.cfg.Clock.Now()
		if p.cfg.OnEnd != nil || p.cfg.Flows != nil {
			info := s.info(now, reason)
			if p.cfg.OnEnd != nil {
				p.ended = append(p.ended, info)
			}
			if p.cfg.Flows != nil {
				p.endedFlow(s, info, now)
			}
		}
		if p.debug() {
			p.log.WithFields(logrus.Fields{"client": s.client, "endpoint": s.endpoint, "reason": reason}).
				Debug("session ended")
		}
	}
	if reason == flow.EndpointRefused {
		s.refused = true
		return
	}
	delete(p.sessions, s.client)
	p.lru.remove(s)
	p.checkDrained()
}

func temporary(err error) bool {
	return errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR)
}

func (p *shard) debug() bool { return loglevel.Debug(p.log) }

// warn logs at most once a second: a flood of bad datagrams must not become a flood of log lines.
// The counters in Stats are exact.
func (p *shard) warn(now time.Time, msg string, err error, fields logrus.Fields) {
	if !p.lastWarn.IsZero() && now.Sub(p.lastWarn) < time.Second {
		return
	}
	p.lastWarn = now
	p.log.WithFields(fields).WithError(err).Warn(msg)
}
