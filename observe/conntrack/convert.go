package conntrack

import (
	"errors"
	"net/netip"

	ct "github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// IDBit marks the flow IDs of the kernel path: an ID with it set is 1<<63 | the conntrack entry's
// id (`conntrack -L -o id` shows it), so an ID names the same entry in the stream and in
// conntrack, and never equals an ID the proxy sockets count up from 1. The kernel gives every
// entry an id; should one come without, bit 62 marks a number the watcher counts itself.
const IDBit = 1 << 63

const ownIDBit = 1 << 62

// tuples reads an entry's protocol, client (original source), local (original destination: the
// service address the client reached) and endpoint (the reply's source: where the kernel path's
// DNAT sent it). ok is false for protocols other than TCP and UDP.
func tuples(f *ct.Flow) (proto flow.Protocol, client, local, endpoint netip.AddrPort, ok bool) {
	switch f.TupleOrig.Proto.Protocol {
	case unix.IPPROTO_TCP:
		proto = flow.TCP
	case unix.IPPROTO_UDP:
		proto = flow.UDP
	default:
		return 0, client, local, endpoint, false
	}
	o, r := f.TupleOrig, f.TupleReply
	client = netip.AddrPortFrom(o.IP.SourceAddress.Unmap(), o.Proto.SourcePort)
	local = netip.AddrPortFrom(o.IP.DestinationAddress.Unmap(), o.Proto.DestinationPort)
	endpoint = netip.AddrPortFrom(r.IP.SourceAddress.Unmap(), r.Proto.SourcePort)
	return proto, client, local, endpoint, true
}

// The TCP conntrack states (include/uapi/linux/netfilter/nf_conntrack_tcp.h).
const (
	tcpSynSent     = 1
	tcpSynRecv     = 2
	tcpEstablished = 3
	tcpFinWait     = 4
	tcpCloseWait   = 5
	tcpLastAck     = 6
	tcpTimeWait    = 7
	tcpClose       = 8
	tcpSynSent2    = 9
)

// tcpCloseInit is IP_CT_TCP_FLAG_CLOSE_INIT: the kernel sets it on the direction whose FIN moved
// the entry to FIN_WAIT, that is on the side that closed first. Kernels up to 6.18 at least send
// the flags in dumps and UPDATE events but not in DESTROY (tcp_to_nlattr skips them there), so
// this names the side only if a kernel ever does.
const tcpCloseInit = 0x04

// ErrReset is the End error of a kernel-path TCP flow that a reset ended: conntrack records the
// reset but not which side sent it, so the reason stays Unknown and this says what is known.
var ErrReset = errors.New("reset by the client or the endpoint (conntrack does not record which)")

// endReason maps a DESTROY to why the flow ended, as far as conntrack knows. The kernel (5.19 and
// later) sends the TCP state and, for an entry deleted before it expired (conntrack -D, a
// flush, the proxy clearing an endpoint's entries), the seconds it had left; an entry that
// expired has none. A TCP connection that never completed its handshake ends in a SYN state or,
// refused, in CLOSE unassured: DialFailed. One assured in CLOSE was reset (ErrReset). One in
// TIME_WAIT closed normally, FIN both ways, but DESTROY does not say who closed first
// (tcpCloseInit): Unknown, with no error. Any other state, expired: IdleTimeout. UDP entries
// end only by expiring (IdleTimeout) or being deleted (Unknown).
func endReason(proto flow.Protocol, f *ct.Flow) (flow.EndReason, error) {
	expired := f.Timeout == 0
	if proto == flow.UDP {
		if expired {
			return flow.IdleTimeout, nil
		}
		return flow.Unknown, nil
	}
	tcp := f.ProtoInfo.TCP
	if tcp == nil {
		return flow.Unknown, nil
	}
	switch tcp.State {
	case tcpTimeWait:
		switch {
		case tcp.OriginalFlags&tcpCloseInit != 0:
			return flow.ClientClosed, nil
		case tcp.ReplyFlags&tcpCloseInit != 0:
			return flow.EndpointClosed, nil
		}
	case tcpClose:
		if !f.Status.Assured() {
			return flow.DialFailed, nil
		}
		return flow.Unknown, ErrReset
	case tcpSynSent, tcpSynSent2, tcpSynRecv:
		return flow.DialFailed, nil
	case tcpEstablished, tcpFinWait, tcpCloseWait, tcpLastAck:
		if expired {
			return flow.IdleTimeout, nil
		}
	}
	return flow.Unknown, nil
}
