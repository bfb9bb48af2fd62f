package udp

import (
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The proxy drives its sockets with raw non-blocking file descriptors and its own epoll set instead
// of net.UDPConn: one goroutine per service port serves the listening socket and every session's
// backend socket, with no goroutine switch per datagram and no EAGAIN read per reply (the Go
// netpoller would park and wake a goroutine for each). The epoll descriptor itself is handed to the
// Go netpoller (an epoll set is pollable), so an idle proxy parks like any goroutine and pins no thread.

// sockaddr is a raw socket address big enough for IPv4 and IPv6, kept in the form the kernel
// reads and writes (port in network byte order) so replies need no conversion.
type sockaddr = unix.RawSockaddrInet6

const sockaddrLen = unix.SizeofSockaddrInet6

func family(a netip.Addr) int {
	if a.Unmap().Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func toSockaddr(ap netip.AddrPort) unix.Sockaddr {
	a := ap.Addr().Unmap()
	if a.Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: a.As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: a.As16()}
}

func fromSockaddr(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// parseRaw decodes a raw address as filled in by recvmmsg.
func parseRaw(rsa *sockaddr) (netip.AddrPort, bool) {
	switch rsa.Family {
	case unix.AF_INET:
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), ntohs(sa4.Port)), true
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16(rsa.Addr).Unmap(), ntohs(rsa.Port)), true
	}
	return netip.AddrPort{}, false
}

func ntohs(raw uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&raw))
	return uint16(b[0])<<8 | uint16(b[1])
}

// socketBufferSize is what the listening socket asks for: a DNS burst from many clients should
// queue in the kernel rather than be dropped while the proxy goroutine is busy (the default
// net.core.rmem_max, 208 KiB, holds only a few hundred small datagrams).
const socketBufferSize = 4 << 20

// listenUDP opens the non-blocking listening socket. IPv6 sockets are v6-only: each address family
// of a dual-stack service gets its own proxy, and v4-mapped client addresses would confuse the
// session keys.
func listenUDP(addr netip.AddrPort) (int, netip.AddrPort, error) {
	fd, err := unix.Socket(family(addr.Addr()), unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, netip.AddrPort{}, os.NewSyscallError("socket", err)
	}
	if family(addr.Addr()) == unix.AF_INET6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); err != nil {
			unix.Close(fd)
			return -1, netip.AddrPort{}, os.NewSyscallError("setsockopt IPV6_V6ONLY", err)
		}
	}
	setBuffer(fd, unix.SO_RCVBUFFORCE, unix.SO_RCVBUF)
	setBuffer(fd, unix.SO_SNDBUFFORCE, unix.SO_SNDBUF)
	if err := unix.Bind(fd, toSockaddr(addr)); err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, os.NewSyscallError("bind", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, os.NewSyscallError("getsockname", err)
	}
	return fd, fromSockaddr(sa), nil
}

// setBuffer sizes a socket buffer, beyond the sysctl cap when the proxy has CAP_NET_ADMIN (the
// *FORCE option), else up to the cap. Best effort: a smaller buffer still works.
func setBuffer(fd, force, capped int) {
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, force, socketBufferSize) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, capped, socketBufferSize)
	}
}

// dialUDP opens a non-blocking socket connected to a backend. Connecting makes the kernel filter
// replies to that endpoint and report its ICMP port unreachable as ECONNREFUSED.
func dialUDP(ep netip.AddrPort) (int, error) {
	fd, err := unix.Socket(family(ep.Addr()), unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	if err := unix.Connect(fd, toSockaddr(ep)); err != nil {
		unix.Close(fd)
		return -1, os.NewSyscallError("connect", err)
	}
	return fd, nil
}

// recvmmsg reads up to len(hs) datagrams without blocking. x/sys/unix has the types but no wrapper.
func recvmmsg(fd int, hs []unix.Mmsghdr) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hs[0])),
		uintptr(len(hs)), unix.MSG_DONTWAIT, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// sendmmsg sends up to len(hs) datagrams; it fails only when the first one fails.
func sendmmsg(fd int, hs []unix.Mmsghdr) (int, error) {
	n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hs[0])),
		uintptr(len(hs)), unix.MSG_DONTWAIT, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// poller is a level-triggered epoll set whose descriptor is registered with the Go netpoller.
type poller struct {
	fd     int
	file   *os.File
	rc     syscall.RawConn
	events []unix.EpollEvent
}

func newPoller(maxEvents int) (*poller, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	// os.NewFile registers only non-blocking descriptors with the netpoller.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("fcntl O_NONBLOCK", err)
	}
	file := os.NewFile(uintptr(fd), "udp-proxy-epoll")
	rc, err := file.SyscallConn()
	if err != nil {
		file.Close()
		return nil, fmt.Errorf("epoll raw conn: %w", err)
	}
	return &poller{fd: fd, file: file, rc: rc, events: make([]unix.EpollEvent, maxEvents)}, nil
}

func (p *poller) add(fd int) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}
	return os.NewSyscallError("epoll_ctl", unix.EpollCtl(p.fd, unix.EPOLL_CTL_ADD, fd, &ev))
}

// wait returns ready events, parking the goroutine in the netpoller while there are none. It
// fails with os.ErrClosed once close has been called, which is how the proxy loop stops.
func (p *poller) wait() ([]unix.EpollEvent, error) {
	var n int
	var werr error
	err := p.rc.Read(func(fd uintptr) bool {
		n, werr = unix.EpollWait(int(fd), p.events, 0)
		if werr == unix.EINTR {
			n, werr = 0, nil
			return true // poll again rather than park: events may be pending
		}
		return n > 0 || werr != nil
	})
	if err != nil {
		return nil, err
	}
	if werr != nil {
		return nil, os.NewSyscallError("epoll_wait", werr)
	}
	return p.events[:n], nil
}

// close releases the epoll set. A concurrent wait returns os.ErrClosed; the descriptor is closed
// when it has.
func (p *poller) close() error { return p.file.Close() }

func closeFD(fd int) error { return os.NewSyscallError("close", unix.Close(fd)) }
