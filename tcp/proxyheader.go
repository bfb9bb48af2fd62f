package tcp

import (
	"net/netip"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// sendProxyHeader writes the PROXY protocol header on the endpoint socket, in one write, before
// either direction starts, so the header is the first thing the endpoint reads and the splice
// path stays as it is. The socket has just connected and its send buffer is empty, so the write
// of at most 107 bytes completes at once; a partial write is finished all the same.
func (c *conn) sendProxyHeader(be *sock, v proxyprotocol.Version) error {
	var buf [proxyprotocol.MaxLen]byte
	var b []byte
	_ = c.client.raw.Control(func(fd uintptr) { b = c.proxyHeader(buf[:0], int(fd), v) })
	var werr error
	err := be.raw.Write(func(fd uintptr) bool {
		for len(b) > 0 {
			n, err := sysWrite(int(fd), b)
			switch err {
			case nil:
				b = b[n:]
			case unix.EINTR:
			case unix.EAGAIN:
				return false
			default:
				werr = os.NewSyscallError("write", err)
				return true
			}
		}
		return true
	})
	if err != nil {
		return err
	}
	return werr
}

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
