package udp

import (
	"errors"
	"fmt"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"net/netip"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The proxy drives its sockets with raw non-blocking file descriptors and its own epoll set instead
// of net.UDPConn: one goroutine per service port serves the listening socket and every session's
// backend socket, with no goroutine switch per datagram and no EAGAIN read per reply (the Go
// netpoller would park and wake a goroutine for each).
//
// That goroutine blocks in epoll_wait itself, so each UDP service port holds one OS thread while
// idle. The alternative, registering the epoll descriptor with the Go netpoller (it is pollable)
// and parking like any goroutine, cost 5-20% more proxy CPU per exchange in bench/udp (-compare
// runs: 18.4 vs 15.3 µs, 19.2 vs 18.3 µs): an extra epoll_wait to find the set empty before
// parking, plus the runtime's netpoll and futex wake-ups.

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
// replies to that endpoint and report its ICMP port unreachable as ECONNREFUSED.
func dialUDP(ep netip.AddrPort) (int, error) {
	fd, err := unix.Socket(sockopt.Family(ep.Addr()), unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, os.NewSyscallError("socket", err)
	}
	if err := unix.Connect(fd, sockopt.ToSockaddr(ep)); err != nil {
		unix.Close(fd)
		return -1, os.NewSyscallError("connect", err)
	}
	return fd, nil
}

// The datagram syscalls below never block (MSG_DONTWAIT, non-blocking sockets), so they use
// RawSyscall and skip the scheduler's entersyscall/exitsyscall bookkeeping, as the runtime does for
// its own non-blocking calls.

// recvmmsg reads up to len(hs) datagrams. x/sys/unix has the types but no wrapper.
func recvmmsg(fd int, hs []unix.Mmsghdr) (int, error) {
	n, _, errno := unix.RawSyscall6(unix.SYS_RECVMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hs[0])),
		uintptr(len(hs)), unix.MSG_DONTWAIT, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// sendmmsg sends up to len(hs) datagrams; it fails only when the first one fails.
func sendmmsg(fd int, hs []unix.Mmsghdr) (int, error) {
	n, _, errno := unix.RawSyscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&hs[0])),
		uintptr(len(hs)), unix.MSG_DONTWAIT, 0, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// poller is a level-triggered epoll set, waited on with a blocking epoll_wait while traffic flows,
// plus an eventfd that wakes the waiter when the proxy closes (closing an epoll descriptor does
// not). A blocking epoll_wait holds an OS thread; after idleAfter without events the wait moves
// into the Go netpoller instead, so an idle service port holds no thread (thousands of idle UDP
// service ports would otherwise run into the runtime's 10,000-thread limit and crash the process).
type poller struct {
	fd     int
	wakeFD int
	events []unix.EpollEvent
	// file/raw are a second epoll set, registered in the Go netpoller. fd is added to it only
	// while parked: registering fd itself would make the
	// runtime's poller wake on every datagram of a busy port (measured: ~40% more CPU/exchange).
	file *os.File
	raw  syscall.RawConn
	busy bool // events came within idleAfter: wait in epoll_wait, holding the thread
}

// idleAfter is how long a wait blocks its thread before it parks in the netpoller.
const idleAfter = time.Second

func newPoller(maxEvents int) (*poller, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("eventfd", err)
	}
	p := &poller{fd: fd, wakeFD: wake, events: make([]unix.EpollEvent, maxEvents)}
	if err := p.add(wake); err != nil {
		p.close()
		return nil, err
	}
	if err := p.openWatch(); err != nil {
		p.close()
		return nil, err
	}
	return p, nil
}

// openWatch creates the nested epoll set the Go netpoller watches while the poller is parked.
func (p *poller) openWatch() error {
	w, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return os.NewSyscallError("epoll_create1", err)
	}
	if err := unix.SetNonblock(w, true); err != nil {
		unix.Close(w)
		return os.NewSyscallError("set epoll descriptor non-blocking", err)
	}
	p.file = os.NewFile(uintptr(w), "udp-epoll-watch")
	if p.raw, err = p.file.SyscallConn(); err != nil {
		return fmt.Errorf("udp epoll in the netpoller: %w", err)
	}
	return nil
}

func (p *poller) add(fd int) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}
	return os.NewSyscallError("epoll_ctl", unix.EpollCtl(p.fd, unix.EPOLL_CTL_ADD, fd, &ev))
}

func (p *poller) remove(fd int) error {
	return os.NewSyscallError("epoll_ctl del", unix.EpollCtl(p.fd, unix.EPOLL_CTL_DEL, fd, nil))
}

// wait blocks until events are ready. The wake eventfd's event is among them after wake.
func (p *poller) wait() ([]unix.EpollEvent, error) {
	for {
		var n int
		var err error
		if p.busy {
			// Traffic flowed since the last park: block the thread, the fastest wake-up.
			n, err = unix.EpollWait(p.fd, p.events, int(idleAfter/time.Millisecond))
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return nil, os.NewSyscallError("epoll_wait", err)
			}
		}
		if n == 0 {
			// Idle (or just started): wait without a thread.
			n, err = p.park()
			if err != nil {
				return nil, err
			}
		}
		p.busy = n > 0
		if n > 0 {
			return p.events[:n], nil
		}
	}
}

// park waits in the Go netpoller until the epoll set has events, holding no OS thread, and
// returns them. The set is watched through the nested watch set only for the time of the park.
func (p *poller) park() (int, error) {
	var n int
	var werr error
	err := p.raw.Control(func(w uintptr) {
		ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(p.fd)}
		werr = unix.EpollCtl(int(w), unix.EPOLL_CTL_ADD, p.fd, &ev)
	})
	if err == nil && werr != nil {
		err = os.NewSyscallError("epoll_ctl add", werr)
	}
	if err != nil {
		return 0, err
	}
	err = p.raw.Read(func(uintptr) bool {
		for {
			n, werr = unix.EpollWait(p.fd, p.events, 0)
			if werr != unix.EINTR {
				return werr != nil || n > 0
			}
		}
	})
	if err == nil && werr != nil {
		err = os.NewSyscallError("epoll_wait", werr)
	}
	if cerr := p.raw.Control(func(w uintptr) { werr = unix.EpollCtl(int(w), unix.EPOLL_CTL_DEL, p.fd, nil) }); err == nil {
		if cerr != nil {
			err = cerr
		} else if werr != nil {
			err = os.NewSyscallError("epoll_ctl del", werr)
		}
	}
	return n, err
}

// wake makes a blocked or the next wait return.
func (p *poller) wake() {
	var one = [8]byte{1}
	_, _ = unix.Write(p.wakeFD, one[:]) // EAGAIN: the counter is already non-zero, still awake
}

// close releases the descriptors. No wait may be in progress or follow.
func (p *poller) close() error {
	var watch error
	if p.file != nil {
		watch = p.file.Close()
	}
	return errors.Join(watch, closeFD(p.wakeFD), closeFD(p.fd))
}

// send writes one datagram to a connected socket.
func send(fd int, data []byte) error {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	} else {
		p = unsafe.Pointer(&zeroByte)
	}
	for {
		_, _, errno := unix.RawSyscall6(unix.SYS_SENDTO, uintptr(fd), uintptr(p), uintptr(len(data)),
			unix.MSG_DONTWAIT, 0, 0)
		switch errno {
		case 0:
			return nil
		case unix.EINTR:
			continue
		}
		return errno
	}
}

var zeroByte byte

func closeFD(fd int) error { return os.NewSyscallError("close", unix.Close(fd)) }

func closeFDs(fds []int) {
	for _, fd := range fds {
		closeFD(fd)
	}
}
