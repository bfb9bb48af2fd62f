package udp

import (
	"fmt"
	"net/netip"
	"os"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// sockaddr is a raw socket address big enough for IPv4 and IPv6, kept in the form the kernel
// reads and writes (port in network byte order) so replies need no conversion.
type sockaddr = unix.RawSockaddrInet6

const sockaddrLen = unix.SizeofSockaddrInet6

// socketBufferSize is what the listening socket asks for: a DNS burst from many clients should
// queue in the kernel rather than be dropped while the proxy goroutine is busy (the default
// net.core.rmem_max, 208 KiB, holds only a few hundred small datagrams).
const socketBufferSize = 4 << 20

// listenUDP opens the non-blocking listening socket. IPv6 sockets are v6-only: each address family
// of a dual-stack service gets its own proxy, and v4-mapped client addresses would confuse the
// session keys. reusePort binds it into the SO_REUSEPORT group already on addr (never with port 0:
// see Proxy.openGroup).
func listenUDP(addr netip.AddrPort, freeBind, reusePort bool) (int, netip.AddrPort, error) {
	fd, err := unix.Socket(sockopt.Family(addr.Addr()), unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, netip.AddrPort{}, os.NewSyscallError("socket", err)
	}
	if freeBind {
		if err := sockopt.SetFreeBind(fd, addr.Addr()); err != nil {
			unix.Close(fd)
			return -1, netip.AddrPort{}, err
		}
	}
	if sockopt.Family(addr.Addr()) == unix.AF_INET6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); err != nil {
			unix.Close(fd)
			return -1, netip.AddrPort{}, os.NewSyscallError("setsockopt IPV6_V6ONLY", err)
		}
	}
	if err := enablePktinfo(fd, sockopt.Family(addr.Addr())); err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, err
	}
	setBuffer(fd, unix.SO_RCVBUFFORCE, unix.SO_RCVBUF)
	setBuffer(fd, unix.SO_SNDBUFFORCE, unix.SO_SNDBUF)
	if reusePort {
		if err := enableReusePort(fd); err != nil {
			unix.Close(fd)
			return -1, netip.AddrPort{}, err
		}
	}
	if err := unix.Bind(fd, sockopt.ToSockaddr(addr)); err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, os.NewSyscallError("bind", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, os.NewSyscallError("getsockname", err)
	}
	return fd, sockopt.FromSockaddr(sa), nil
}

// adoptUDP takes a socket another process bound (a hand-over) and sets on it what listenUDP
// would: the predecessor may be another version.
func adoptUDP(fd int, addr netip.AddrPort) (int, netip.AddrPort, error) {
	err := os.NewSyscallError("set non-blocking", unix.SetNonblock(fd, true))
	if err == nil {
		err = enablePktinfo(fd, sockopt.Family(addr.Addr()))
	}
	var sa unix.Sockaddr
	if err == nil {
		setBuffer(fd, unix.SO_RCVBUFFORCE, unix.SO_RCVBUF)
		setBuffer(fd, unix.SO_SNDBUFFORCE, unix.SO_SNDBUF)
		sa, err = unix.Getsockname(fd)
		err = os.NewSyscallError("getsockname", err)
	}
	if err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, fmt.Errorf("adopt a handed-over socket: %w", err)
	}
	return fd, sockopt.FromSockaddr(sa), nil
}

// enableReusePort sets SO_REUSEPORT. On a bound socket it lets later sockets bound with it join
// its group: the kernel builds the group when the second one binds.
func enableReusePort(fd int) error {
	return os.NewSyscallError("setsockopt SO_REUSEPORT", unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1))
}

// setBuffer sizes a socket buffer, beyond the sysctl cap when the proxy has CAP_NET_ADMIN (the
// *FORCE option), else up to the cap. Best effort: a smaller buffer still works.
func setBuffer(fd, force, capped int) {
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, force, socketBufferSize) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, capped, socketBufferSize)
	}
}

// dialUDP opens a non-blocking socket connected to a backend. Connecting makes the kernel filter
// replies to that endpoint and report its ICMP port unreachable as ECONNREFUSED. If src is valid
// (a transparent session) the socket is bound to it first (bindSource); that failing wraps
// errSourceTaken.
func dialUDP(ep, src netip.AddrPort) (int, error) {
	fd, err := unix.Socket(sockopt.Family(ep.Addr()), unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	if src.IsValid() {
		if err := bindSource(fd, src); err != nil {
			unix.Close(fd)
			return -1, err
		}
	}
	if err := unix.Connect(fd, sockopt.ToSockaddr(ep)); err != nil {
		unix.Close(fd)
		return -1, os.NewSyscallError("connect", err)
	}
	return fd, nil
}

func closeFD(fd int) error { return os.NewSyscallError("close", unix.Close(fd)) }

func closeFDs(fds []int) {
	for _, fd := range fds {
		closeFD(fd)
	}
}
