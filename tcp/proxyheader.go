package tcp

import (
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// proxyHeader appends the header of version v for this connection, whose client socket is fd.
func (c *conn) proxyHeader(b []byte, fd int, v proxyprotocol.Version) []byte {
	h := proxyprotocol.Header{Source: c.clientAddr, Destination: c.serviceAddr(fd)}
	return h.Append(b, v)
}

// serviceAddr is the address the client connected to: in iptables mode the portal rule redirected
// the connection, and conntrack still knows where it was going (SO_ORIGINAL_DST: the cluster IP,
// node port or external address and the service port); in bind mode, or without conntrack, the
// socket's local address is the service address itself. Invalid if neither is known, and the
// header then says the addresses are unknown. Two syscalls, paid only by ports that send the
// header.
func (c *conn) serviceAddr(fd int) netip.AddrPort {
	if a, err := originalDst(fd, c.clientAddr.Addr().Is4()); err == nil {
		return a
	}
	if sa, err := unix.Getsockname(fd); err == nil {
		return sockopt.FromSockaddr(sa)
	}
	return netip.AddrPort{}
}

// originalDst asks conntrack for the destination of the connection before NAT (netfilter's
// SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST for IPv6: the same option number at SOL_IPV6). It fails
// with ENOENT when conntrack has no entry for the connection.
func originalDst(fd int, v4 bool) (netip.AddrPort, error) {
	var rsa unix.RawSockaddrInet6 // the larger of the two families
	n := uint32(unsafe.Sizeof(rsa))
	level := unix.SOL_IP
	if !v4 {
		level = unix.SOL_IPV6
	}
	_, _, e := unix.RawSyscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), unix.SO_ORIGINAL_DST,
		uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)), 0)
	if e != 0 {
		return netip.AddrPort{}, e
	}
	a, ok := sockopt.ParseRaw(&rsa)
	if !ok {
		return netip.AddrPort{}, unix.EAFNOSUPPORT
	}
	return a, nil
}
