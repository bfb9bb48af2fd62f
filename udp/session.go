package udp

import (
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// session is one client address with its own socket connected to the endpoint picked for it.
// Sessions are owned by the proxy and touched only under Proxy.mu.
type session struct {
	client   netip.AddrPort
	endpoint netip.AddrPort
	fd       int // connected backend socket; -1 once closed
	// refused marks a session whose endpoint answered with ICMP port unreachable. It stays in the
	// table, without a socket, so the client's next datagram re-picks with affinity reset.
	refused bool
	// awaiting: the client's last datagram went to the endpoint after its last reply, so a reply
	// may still come. A released proxy keeps only such sessions for long (see Release).
	awaiting bool

	// clientAddr is the client in kernel form, the destination of every reply.
	clientAddr    sockaddr
	clientAddrLen uint32
	// local is the address the client's datagrams were delivered to; replyCtrl makes it the
	// source of every reply (see pktinfo.go).
	local        netip.Addr
	replyCtrl    control
	replyCtrlLen int

	started, lastActive time.Time
	pktsTo, bytesTo     uint64
	pktsFrom, bytesFrom uint64
	lruPrev, lruNext    *session

	// The live flow stream (flows.go), while Config.Flows is set.
	id     uint64
	pick   flow.Pick
	source netip.AddrPort // the session socket's own address
	tap    flow.Tap
	// transparent: the session's socket is bound to the client's address (Info).
	transparent bool
}

// setLocal records the address the client's latest datagram was delivered to. A client that sends
// from one address and port to two portal addresses of the same service port gets its replies
// from the latest; that is unusual enough not to key sessions by local address too.
func (s *session) setLocal(local netip.Addr) {
	if local != s.local {
		s.local = local
		s.replyCtrlLen = sourceControl(&s.replyCtrl, local)
	}
}

func (s *session) info(end time.Time, reason flow.EndReason) flow.Info {
	return flow.Info{
		Client:            s.client,
		Endpoint:          s.endpoint,
		Start:             s.started,
		LastActive:        s.lastActive,
		Duration:          end.Sub(s.started),
		PacketsToEndpoint: s.pktsTo,
		BytesToEndpoint:   s.bytesTo,
		PacketsToClient:   s.pktsFrom,
		BytesToClient:     s.bytesFrom,
		Transparent:       s.transparent,
		End:               reason,
	}
}

// lru is an intrusive list of sessions, most recently active at the front. Moving a session on
// every datagram is three pointer writes, and expiry only ever looks at the back.
type lru struct {
	front, back *session
}

func (l *lru) pushFront(s *session) {
	s.lruPrev, s.lruNext = nil, l.front
	if l.front != nil {
		l.front.lruPrev = s
	} else {
		l.back = s
	}
	l.front = s
}

func (l *lru) remove(s *session) {
	if s.lruPrev != nil {
		s.lruPrev.lruNext = s.lruNext
	} else {
		l.front = s.lruNext
	}
	if s.lruNext != nil {
		s.lruNext.lruPrev = s.lruPrev
	} else {
		l.back = s.lruPrev
	}
	s.lruPrev, s.lruNext = nil, nil
}

func (l *lru) moveToFront(s *session) {
	if l.front == s {
		return
	}
	l.remove(s)
	l.pushFront(s)
}
