package portal

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The rtnetlink messages Netlink sends, built and parsed by hand: a link by name, a dummy (or
// bridge) link, its up flag, and the address dump. Netlink messages use the host's byte order.

var ne = binary.NativeEndian

const (
	nlRecvTimeout = 10 // seconds; the kernel answers at once, this only bounds a broken socket
	nlaTypeMask   = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
	dumpRetries   = 5
	// localRouteWait bounds how long an IPv6 address add waits for the address's local route.
	localRouteWait = 2 * time.Second
)

// nlConn is one NETLINK_ROUTE socket, used by one goroutine at a time.
type nlConn struct {
	fd  int
	seq uint32
	buf []byte
	// While collect is set, route notifications are kept in pending instead of skipped.
	collect bool
	pending []nlMsg
}

// nlMsg is one received message: its header and its payload (after the header).
type nlMsg struct {
	hdr  unix.NlMsghdr
	data []byte
}

// nlError is an error the kernel answered, with the extended ack message when there is one.
type nlError struct {
	op    string
	errno unix.Errno
	msg   string
}

func (e *nlError) Error() string {
	if e.msg != "" {
		return fmt.Sprintf("%s: %v (%s)", e.op, e.errno, e.msg)
	}
	return fmt.Sprintf("%s: %v", e.op, e.errno)
}

func (e *nlError) Unwrap() error { return e.errno }

var (
	errDumpInterrupted = errors.New("netlink dump interrupted by a concurrent change")
	// errNetlinkSocket marks a failure of the socket itself (not an answer from the kernel).
	errNetlinkSocket = errors.New("netlink socket")
)

// dialNetlink opens a socket; groups subscribes to multicast groups (0 for requests only). ctx
// only cuts the open short when it is already done.
func dialNetlink(ctx context.Context, groups uint32) (*nlConn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink socket: %w", err)
	}
	// Errors carry the kernel's own words ("Unknown device type"), and acks do not echo requests.
	// Both are best effort: old kernels answer without them.
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1)
	tv := unix.Timeval{Sec: nlRecvTimeout}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink socket timeout: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: groups}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netlink bind: %w", err)
	}
	return &nlConn{fd: fd, buf: make([]byte, 1<<16)}, nil
}

func (c *nlConn) Close() error { return unix.Close(c.fd) }

// request sends one message and returns the payloads of the replies: for a dump (NLM_F_DUMP) each
// message until NLMSG_DONE, otherwise each message until the ack, which every request asks for.
func (c *nlConn) request(op string, typ, flags uint16, body []byte) ([][]byte, error) {
	c.seq++
	flags |= unix.NLM_F_REQUEST
	dump := flags&unix.NLM_F_DUMP == unix.NLM_F_DUMP
	if !dump {
		flags |= unix.NLM_F_ACK
	}
	msg := make([]byte, unix.SizeofNlMsghdr, unix.SizeofNlMsghdr+len(body))
	ne.PutUint32(msg[0:], uint32(unix.SizeofNlMsghdr+len(body)))
	ne.PutUint16(msg[4:], typ)
	ne.PutUint16(msg[6:], flags)
	ne.PutUint32(msg[8:], c.seq)
	msg = append(msg, body...)
	if err := unix.Sendto(c.fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("%s: %w: send: %w", op, errNetlinkSocket, err)
	}
	var out [][]byte
	interrupted := false
	for {
		msgs, err := c.recv(0)
		if err != nil {
			return nil, fmt.Errorf("%s: %w: receive: %w", op, errNetlinkSocket, err)
		}
		for _, m := range msgs {
			if c.collect && m.hdr.Type == unix.RTM_NEWROUTE {
				c.pending = append(c.pending, m)
				continue
			}
			if m.hdr.Seq != c.seq {
				continue
			}
			interrupted = interrupted || m.hdr.Flags&unix.NLM_F_DUMP_INTR != 0
			switch m.hdr.Type {
			case unix.NLMSG_ERROR:
				if err := parseNlError(op, m); err != nil {
					return nil, err
				}
				return out, nil // the ack
			case unix.NLMSG_DONE:
				if len(m.data) >= 4 {
					if errno := int32(ne.Uint32(m.data)); errno < 0 {
						return nil, &nlError{op: op, errno: unix.Errno(-errno)}
					}
				}
				if interrupted {
					return nil, fmt.Errorf("%s: %w", op, errDumpInterrupted)
				}
				return out, nil
			default:
				out = append(out, m.data)
			}
		}
	}
}

// recv reads one datagram of messages; flags is passed to recvfrom (MSG_DONTWAIT to poll).
func (c *nlConn) recv(flags int) ([]nlMsg, error) {
	for {
		n, _, err := unix.Recvfrom(c.fd, c.buf, flags)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return parseNlMsgs(c.buf[:n])
	}
}

func parseNlMsgs(b []byte) ([]nlMsg, error) {
	var out []nlMsg
	for len(b) >= unix.SizeofNlMsghdr {
		h := unix.NlMsghdr{Len: ne.Uint32(b), Type: ne.Uint16(b[4:]), Flags: ne.Uint16(b[6:]),
			Seq: ne.Uint32(b[8:]), Pid: ne.Uint32(b[12:])}
		if h.Len < unix.SizeofNlMsghdr || int(h.Len) > len(b) {
			return nil, fmt.Errorf("netlink: malformed message (length %d of %d)", h.Len, len(b))
		}
		data := make([]byte, int(h.Len)-unix.SizeofNlMsghdr)
		copy(data, b[unix.SizeofNlMsghdr:h.Len])
		out = append(out, nlMsg{hdr: h, data: data})
		b = b[min(nlAlign(int(h.Len)), len(b)):]
	}
	return out, nil
}

// parseNlError returns nil for an ack, or the error with the kernel's extended ack message.
func parseNlError(op string, m nlMsg) error {
	if len(m.data) < 4 {
		return fmt.Errorf("%s: short netlink error message", op)
	}
	errno := int32(ne.Uint32(m.data))
	if errno == 0 {
		return nil
	}
	e := &nlError{op: op, errno: unix.Errno(-errno)}
	if m.hdr.Flags&unix.NLM_F_ACK_TLVS == 0 || len(m.data) < 4+unix.SizeofNlMsghdr {
		return e
	}
	off := 4 + unix.SizeofNlMsghdr // the echoed request header; its payload too unless capped
	if m.hdr.Flags&unix.NLM_F_CAPPED == 0 {
		off = 4 + int(ne.Uint32(m.data[4:]))
	}
	if off <= len(m.data) {
		if msg, ok := parseAttrs(m.data[off:])[unix.NLMSGERR_ATTR_MSG]; ok {
			e.msg = cString(msg)
		}
	}
	return e
}

func nlAlign(n int) int { return (n + 3) &^ 3 }

// attr encodes one attribute, padded.
func attr(typ uint16, data []byte) []byte {
	b := make([]byte, nlAlign(4+len(data)))
	ne.PutUint16(b, uint16(4+len(data)))
	ne.PutUint16(b[2:], typ)
	copy(b[4:], data)
	return b
}

func attrString(typ uint16, s string) []byte { return attr(typ, append([]byte(s), 0)) }

// parseAttrs maps each attribute type (flags masked off) to its payload; a later one wins.
func parseAttrs(b []byte) map[uint16][]byte {
	out := map[uint16][]byte{}
	for len(b) >= 4 {
		l := int(ne.Uint16(b))
		if l < 4 || l > len(b) {
			break
		}
		out[ne.Uint16(b[2:])&nlaTypeMask] = b[4:l]
		b = b[min(nlAlign(l), len(b)):]
	}
	return out
}

func cString(b []byte) string {
	s, _, _ := strings.Cut(string(b), "\x00")
	return s
}

// ifinfomsg encodes struct ifinfomsg.
func ifinfomsg(index int32, flags, change uint32) []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	ne.PutUint32(b[4:], uint32(index))
	ne.PutUint32(b[8:], flags)
	ne.PutUint32(b[12:], change)
	return b
}

// nlLink is what we read of a link.
type nlLink struct {
	index int32
	flags uint32
	kind  string
}

func (c *nlConn) getLink(name string) (nlLink, error) {
	body := append(ifinfomsg(0, 0, 0), attrString(unix.IFLA_IFNAME, name)...)
	msgs, err := c.request("RTM_GETLINK "+name, unix.RTM_GETLINK, 0, body)
	if errors.Is(err, unix.ENODEV) {
		return nlLink{}, fmt.Errorf("link %s: %w", name, ErrLinkNotFound)
	}
	if err != nil {
		return nlLink{}, err
	}
	for _, m := range msgs {
		if len(m) < unix.SizeofIfInfomsg {
			continue
		}
		l := nlLink{index: int32(ne.Uint32(m[4:])), flags: ne.Uint32(m[8:])}
		if info, ok := parseAttrs(m[unix.SizeofIfInfomsg:])[unix.IFLA_LINKINFO]; ok {
			l.kind = cString(parseAttrs(info)[unix.IFLA_INFO_KIND])
		}
		return l, nil
	}
	return nlLink{}, fmt.Errorf("link %s: RTM_GETLINK: no link in the answer", name)
}

func (c *nlConn) addLink(name, kind string) error {
	info := attr(unix.IFLA_LINKINFO|unix.NLA_F_NESTED, attrString(unix.IFLA_INFO_KIND, kind))
	body := append(ifinfomsg(0, unix.IFF_UP, unix.IFF_UP), attrString(unix.IFLA_IFNAME, name)...)
	body = append(body, info...)
	_, err := c.request("RTM_NEWLINK "+name+" type "+kind, unix.RTM_NEWLINK, unix.NLM_F_CREATE|unix.NLM_F_EXCL, body)
	if errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("link %s: %w: %w", name, ErrKindUnsupported, err)
	}
	return err
}

func (c *nlConn) setUp(index int32, name string) error {
	_, err := c.request("RTM_NEWLINK "+name+" up", unix.RTM_NEWLINK, 0, ifinfomsg(index, unix.IFF_UP, unix.IFF_UP))
	return err
}

func (c *nlConn) delLink(index int32, name string) error {
	_, err := c.request("RTM_DELLINK "+name, unix.RTM_DELLINK, 0, ifinfomsg(index, 0, 0))
	if errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("link %s: %w", name, ErrLinkNotFound)
	}
	return err
}

// addrs dumps every address of the namespace and keeps those of the link. A dump that a
// concurrent change made inconsistent is repeated.
func (c *nlConn) addrs(index int32) ([]netip.Prefix, error) {
	var msgs [][]byte
	var err error
	for range dumpRetries {
		msgs, err = c.request("RTM_GETADDR", unix.RTM_GETADDR, unix.NLM_F_DUMP, make([]byte, unix.SizeofIfAddrmsg))
		if !errors.Is(err, errDumpInterrupted) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, m := range msgs {
		if p, idx, ok := parseIfAddr(m); ok && idx == index {
			out = append(out, p)
		}
	}
	return out, nil
}

// parseIfAddr reads struct ifaddrmsg and its address: IFA_LOCAL when present (on a point-to-point
// link IFA_ADDRESS is the peer), else IFA_ADDRESS.
func parseIfAddr(m []byte) (netip.Prefix, int32, bool) {
	if len(m) < unix.SizeofIfAddrmsg {
		return netip.Prefix{}, 0, false
	}
	bits, index := int(m[1]), int32(ne.Uint32(m[4:]))
	attrs := parseAttrs(m[unix.SizeofIfAddrmsg:])
	raw, ok := attrs[unix.IFA_LOCAL]
	if !ok {
		raw = attrs[unix.IFA_ADDRESS]
	}
	a, ok := netip.AddrFromSlice(raw)
	if !ok {
		return netip.Prefix{}, 0, false
	}
	return netip.PrefixFrom(a, bits), index, true
}

// changeAddr adds (RTM_NEWADDR) or deletes (RTM_DELADDR) one address. IPv6 addresses skip
// duplicate address detection: a tentative address is not local yet (no local route, bind fails
// without IP_FREEBIND), and on a link without carrier, like a bridge without ports, it would stay
// tentative for good.
func (c *nlConn) changeAddr(typ uint16, index int32, p netip.Prefix) error {
	a := p.Addr().Unmap()
	b := make([]byte, unix.SizeofIfAddrmsg)
	b[0], b[1] = unix.AF_INET, byte(p.Bits())
	if a.Is6() {
		b[0], b[2] = unix.AF_INET6, unix.IFA_F_NODAD
	}
	ne.PutUint32(b[4:], uint32(index))
	if a.Is4() {
		b = append(b, attr(unix.IFA_LOCAL, a.AsSlice())...)
	}
	b = append(b, attr(unix.IFA_ADDRESS, a.AsSlice())...)
	op, flags := "RTM_NEWADDR "+p.String(), uint16(unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	if typ == unix.RTM_DELADDR {
		op, flags = "RTM_DELADDR "+p.String(), 0
	}
	_, err := c.request(op, typ, flags, b)
	return err
}

// addAddr6 adds an IPv6 address and returns once the kernel routes it locally. The kernel inserts
// an IPv6 address's local route from a work item after it acks RTM_NEWADDR (even with nodad);
// until then the address's /128 prefix route in the main table sends its packets into the link,
// and a TCP socket that connects in that window caches that route and never gets through. So
// the socket listens to IPv6 route notifications during the add and waits for that local route.
func (c *nlConn) addAddr6(index int32, p netip.Prefix) error {
	op := "RTM_NEWADDR " + p.String()
	if err := unix.SetsockoptInt(c.fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, unix.RTNLGRP_IPV6_ROUTE); err != nil {
		return fmt.Errorf("%s: %w: join route notifications: %w", op, errNetlinkSocket, err)
	}
	c.collect, c.pending = true, nil
	defer func() {
		c.collect, c.pending = false, nil
		_ = unix.SetsockoptInt(c.fd, unix.SOL_NETLINK, unix.NETLINK_DROP_MEMBERSHIP, unix.RTNLGRP_IPV6_ROUTE)
	}()
	if err := c.changeAddr(unix.RTM_NEWADDR, index, p); err != nil {
		return err // EEXIST included: an address already there has had its route for a while
	}
	deadline := time.Now().Add(localRouteWait)
	for {
		if slices.ContainsFunc(c.pending, func(m nlMsg) bool { return isLocalRoute6(m, p.Addr()) }) {
			return nil
		}
		c.pending = c.pending[:0]
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("%s: the kernel did not route the address locally within %v", op, localRouteWait)
		}
		fds := []unix.PollFd{{Fd: int32(c.fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(fds, int(left/time.Millisecond)+1); err != nil && !errors.Is(err, unix.EINTR) {
			return fmt.Errorf("%s: %w: poll: %w", op, errNetlinkSocket, err)
		}
		msgs, err := c.recv(unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EAGAIN) {
			continue
		}
		if err != nil {
			return fmt.Errorf("%s: %w: receive: %w", op, errNetlinkSocket, err)
		}
		for _, m := range msgs {
			if m.hdr.Type == unix.RTM_NEWROUTE {
				c.pending = append(c.pending, m)
			}
		}
	}
}

// isLocalRoute6 tells whether m announces the local route (type local, /128) of a.
func isLocalRoute6(m nlMsg, a netip.Addr) bool {
	if m.hdr.Type != unix.RTM_NEWROUTE || len(m.data) < unix.SizeofRtMsg {
		return false
	}
	if m.data[0] != unix.AF_INET6 || m.data[1] != 128 || m.data[7] != unix.RTN_LOCAL {
		return false
	}
	dst, ok := netip.AddrFromSlice(parseAttrs(m.data[unix.SizeofRtMsg:])[unix.RTA_DST])
	return ok && dst == a
}
