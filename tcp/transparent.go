package tcp

// Transparent source: a connection's endpoint leg dialed from the client's own address and
// port, so the endpoint sees the client, not the node. The socket gets IP_TRANSPARENT
// (IPV6_TRANSPARENT), which lets it bind an address that is not the node's, and SO_REUSEADDR, then
// is bound to the client's address and port before the connect. The endpoint's replies are
// addressed to the client; the node's plumbing (package portal/transparent: a mangle rule that
// marks packets of transparent sockets, and a routing table that delivers marked packets locally)
// brings them back to this socket instead of forwarding them. Without that plumbing the replies
// go to the real client, which resets them, and the dial times out: the policy must say
// transparent only where the plumbing is in place.

import (
	"errors"
	"net/netip"
	"os"
	"unsafe"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/loglevel"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// errSourceTaken marks a dial that could not take the client's address (see dialSource's
// fallback): a local matter, nothing said about the endpoint.
var errSourceTaken = errors.New("transparent source not available")

// dialSource returns the address a dial to ep binds: the client's when the policy says so, else
// the zero AddrPort (the proxy's own, chosen by connect). Only the dialer calls it (the epoll
// engine's dialing goroutine, the io_uring engine's loop), which owns c.noTransparent.
//
// The choice is per attempt, as the policy's answer depends on the endpoint: the attempts of one
// connection to the same endpoint (a retry of a timed-out dial, a dial backing off for want of
// descriptors) all get the same answer, an attempt to another endpoint gets that one's. After a
// fallback every later attempt of the connection dials from the proxy's address too: what took
// the client's address away (a permission, a socket on the client's port) lasts.
func (c *conn) dialSource(ep netip.AddrPort) netip.AddrPort {
	pol := c.p.source
	if pol == nil || c.noTransparent {
		return netip.AddrPort{}
	}
	client, epa := c.clientAddr.Addr().Unmap(), ep.Addr().Unmap()
	// A client of the other family (a v4 client of a v6 endpoint through a dual-stack
	// listener: v4-mapped before Unmap) cannot be the source of a packet to the endpoint.
	if client.Is4() != epa.Is4() || !pol.Transparent(client, epa) {
		return netip.AddrPort{}
	}
	return c.transparentSource()
}

// transparentSource is the client's address and port as a dial's source.
func (c *conn) transparentSource() netip.AddrPort {
	return netip.AddrPortFrom(c.clientAddr.Addr().Unmap(), c.clientAddr.Port())
}

// sourceFailed records that a dial from src, the client's address, failed locally with err: the
// connection dials from the proxy's own address from now on. Logged at debug: a client reusing
// its port too fast, or a node without the capability, would log a line per connection.
func (c *conn) sourceFailed(src, ep netip.AddrPort, err error) {
	c.noTransparent = true
	c.p.count().transparentFallbacks.Add(1)
	if l := c.p.cfg.Logger; loglevel.Debug(l) {
		c.logger().WithFields(logrus.Fields{"endpoint": ep, "source": src}).WithError(err).
			Debug("transparent dial: the client's address is not available, dialing from the proxy's")
	}
}

// bindSource prepares fd, a new TCP socket of src's family, to connect from src, an address of
// another host: IP_TRANSPARENT (IPV6_TRANSPARENT) allows the bind (it needs CAP_NET_ADMIN), and
// SO_REUSEADDR lets the bind share the port with the listener's accepted socket and with
// sockets in TIME_WAIT, which the connect's own 4-tuple check then arbitrates. The error wraps
// errSourceTaken.
func bindSource(fd int, src netip.AddrPort) error {
	a := src.Addr()
	var e error
	if a.Is4() {
		e = sysSetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
	} else {
		e = sysSetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
	}
	if e != nil {
		return sourceError("setsockopt IP_TRANSPARENT", e)
	}
	if e = sysSetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); e != nil {
		return sourceError("setsockopt SO_REUSEADDR", e)
	}
	if e = sysBind(fd, src); e != nil {
		return sourceError("bind "+src.String(), e)
	}
	return nil
}

func sourceError(op string, errno error) error {
	return errors.Join(errSourceTaken, os.NewSyscallError(op, errno))
}

// sysBind binds fd to ap without building a unix.Sockaddr (an allocation).
func sysBind(fd int, ap netip.AddrPort) error {
	a := ap.Addr().Unmap()
	var e unix.Errno
	if a.Is4() {
		sa := unix.RawSockaddrInet4{Family: unix.AF_INET, Port: sockopt.Htons(ap.Port()), Addr: a.As4()}
		_, _, e = unix.RawSyscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&sa)), unsafe.Sizeof(sa))
	} else {
		sa := unix.RawSockaddrInet6{Family: unix.AF_INET6, Port: sockopt.Htons(ap.Port()), Addr: a.As16()}
		_, _, e = unix.RawSyscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&sa)), unsafe.Sizeof(sa))
	}
	return errnoErr(e)
}
