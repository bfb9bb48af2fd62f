package tcp

import (
	"net/netip"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// The socket calls of the connection path never block (every descriptor is non-blocking), so they
// are made with RawSyscall, as the runtime makes its own non-blocking calls, instead of through
// x/sys/unix's wrappers, which use Syscall. Syscall marks the goroutine's P as in a system call
// (entersyscall/exitsyscall), and when a call lasts longer than sysmon's 20 µs tick, as a loopback
// connect, write or close often does because it runs the receiving side's TCP work inline, sysmon
// hands the P to another thread: a futex wake-up and a context switch, then the way back. In a
// perf profile of the proxy under bench/tcp, sysmon's wake-ups took 4.6% of the samples and
// thread hand-offs 2.1%; with raw calls the proxy's CPU per keep-alive request fell 10-15%
// (bench/suite -quick, A/B). The UDP proxy makes the same choice (udp/sys.go).

func result(r, _ uintptr, e syscall.Errno) (int, error) {
	if e != 0 {
		return 0, e
	}
	return int(r), nil
}

func errnoErr(e syscall.Errno) error {
	if e != 0 {
		return e
	}
	return nil
}

func sysRead(fd int, p []byte) (int, error) {
	return result(unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p))))
}

func sysWrite(fd int, p []byte) (int, error) {
	return result(unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p))))
}

// sysSplice moves up to n bytes from rfd to wfd (one of them a pipe), never blocking.
func sysSplice(rfd, wfd, n int) (int, error) {
	return result(unix.RawSyscall6(unix.SYS_SPLICE, uintptr(rfd), 0, uintptr(wfd), 0, uintptr(n),
		unix.SPLICE_F_NONBLOCK|unix.SPLICE_F_MOVE))
}

func sysShutdownWrite(fd int) error {
	_, _, e := unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), unix.SHUT_WR, 0)
	return errnoErr(e)
}

// sysSendEmpty sends zero bytes: see dialSock.
func sysSendEmpty(fd int) error {
	_, _, e := unix.RawSyscall6(unix.SYS_SENDTO, uintptr(fd), 0, 0, unix.MSG_NOSIGNAL, 0, 0)
	return errnoErr(e)
}

func sysSetsockoptInt(fd, level, opt, v int) error {
	v32 := int32(v)
	_, _, e := unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&v32)), 4, 0)
	return errnoErr(e)
}

// sysAccept accepts a connection as a non-blocking, close-on-exec socket and returns its peer.
func sysAccept(lfd int) (int, netip.AddrPort, error) {
	var rsa unix.RawSockaddrInet6 // the larger of the two families
	n := uint32(unsafe.Sizeof(rsa))
	r, _, e := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(lfd), uintptr(unsafe.Pointer(&rsa)),
		uintptr(unsafe.Pointer(&n)), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
	if e != 0 {
		return -1, netip.AddrPort{}, e
	}
	peer, _ := sockopt.ParseRaw(&rsa)
	return int(r), peer, nil
}

// sysConnect starts a non-blocking connect to ep (EINPROGRESS while the handshake runs).
func sysConnect(fd int, ep netip.AddrPort) error {
	a := ep.Addr().Unmap()
	var e syscall.Errno
	if a.Is4() {
		sa := unix.RawSockaddrInet4{Family: unix.AF_INET, Port: sockopt.Htons(ep.Port()), Addr: a.As4()}
		_, _, e = unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa)), unsafe.Sizeof(sa))
	} else {
		sa := unix.RawSockaddrInet6{Family: unix.AF_INET6, Port: sockopt.Htons(ep.Port()), Addr: a.As16()}
		_, _, e = unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa)), unsafe.Sizeof(sa))
	}
	return errnoErr(e)
}

// sysSocket opens a non-blocking, close-on-exec TCP socket of family.
func sysSocket(family int) (int, error) {
	return result(unix.RawSyscall(unix.SYS_SOCKET, uintptr(family), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0))
}

func sysClose(fd int) {
	unix.RawSyscall(unix.SYS_CLOSE, uintptr(fd), 0, 0)
}

// sysLingerZero makes close send RST (SO_LINGER with a zero timeout).
func sysLingerZero(fd int) {
	l := unix.Linger{Onoff: 1, Linger: 0}
	unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_LINGER, uintptr(unsafe.Pointer(&l)), unsafe.Sizeof(l), 0)
}
