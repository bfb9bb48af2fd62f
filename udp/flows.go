package udp

// The live flow stream (Config.Flows): a session's Start and End as flow.Events, and the
// datagrams of a captured one. With Flows nil a session pays one nil check per phase and per
// datagram.

import (
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// next asks the picker for an endpoint, with its reasons when flows are recorded.
func (p *shard) next(client netip.Addr, reset bool) (netip.AddrPort, flow.Pick, error) {
	if p.cfg.Flows != nil {
		if e, ok := p.picker.(flow.Explainer); ok {
			return e.NextWhy(client, reset)
		}
	}
	ep, err := p.picker.Next(client, reset)
	return ep, flow.Pick{}, err
}

// record hands the Recorder the event of phase ph of session s (nil: a datagram refused before
// any session) with info. It fills the shard's one Event, under p.mu: an Event on the stack
// would escape through the interface call, an allocation per event.
func (p *shard) record(ph flow.Phase, s *session, info flow.Info, now time.Time) {
	e := &p.ev
	*e = flow.Event{Phase: ph, Time: now, Info: info}
	if s != nil {
		e.ID, e.Local, e.Source, e.Pick = s.id, s.serviceAddr(p), s.source, s.pick
	} else {
		e.ID, e.Local = flow.NextID(), p.listenAddr()
	}
	p.cfg.Flows.Record(e)
}

// started records a new session's Start and asks a capturing Recorder whether to capture it.
func (p *shard) started(s *session, local netip.Addr, now time.Time) {
	s.id = flow.NextID()
	if o, ok := p.cfg.Flows.(flow.Observed); !ok || o.Observed() {
		s.source = sockopt.SockName(s.fd) // a system call per session: only while someone watches
	}
	s.setLocal(local)
	p.record(flow.PhaseStart, s, s.info(now, flow.Unknown), now)
	if c, ok := p.cfg.Flows.(flow.Capturer); ok {
		s.tap = c.Capture(&p.ev)
	}
}

// ended records a session's End and closes its tap.
func (p *shard) endedFlow(s *session, info flow.Info, now time.Time) {
	p.record(flow.PhaseEnd, s, info, now)
	if s.tap != nil {
		s.tap.Close()
		s.tap = nil
	}
}

// serviceAddr is where the session's client sent its datagrams: the address they were
// delivered to, on the proxy socket's port.
func (s *session) serviceAddr(p *shard) netip.AddrPort {
	l := p.listenAddr()
	if s.local.IsValid() && !s.local.IsUnspecified() {
		return netip.AddrPortFrom(s.local, l.Port())
	}
	return l
}

// listenAddr is the proxy socket's bound address, read once. The caller holds p.mu.
func (p *shard) listenAddr() netip.AddrPort {
	if p.lfd < 0 {
		return netip.AddrPort{}
	}
	if !p.laddr.IsValid() {
		p.laddr = sockopt.SockName(p.lfd)
	}
	return p.laddr
}
