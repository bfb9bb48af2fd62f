package main

import (
	"fmt"
	"io"
	"net/netip"
	"os"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The evloop target is an experiment, not the product: a minimal TCP forwarder built on raw epoll
// event loops (one per GOMAXPROCS, each with its own SO_REUSEPORT listener, edge-triggered, no
// goroutine per connection), to measure how close a rewrite of the proxy's data path around event
// loops could come to HAProxy and nginx before anyone undertakes it. It forwards both ways with
// half-close and resets on errors, and nothing else: no dial retries or timeouts, no splice, no
// idle timeout, no statistics.
//
//	go run ./bench/tcp -only kpp,evloop,haproxy,nginx

// runEvloop serves the echo and sink endpoints through event loops on -listen-echo and -listen-sink.
func runEvloop() error {
	loops := runtime.GOMAXPROCS(0)
	for _, ep := range []struct{ name, addr, listen string }{{"echo", *echoEP, *listenEcho}, {"sink", *sinkEP, *listenSink}} {
		backend := netip.MustParseAddrPort(ep.addr)
		listen := netip.MustParseAddrPort(ep.listen)
		port := int(listen.Port())
		for i := 0; i < loops; i++ {
			lfd, bound, err := evListen(listen.Addr(), port)
			if err != nil {
				return err
			}
			port = bound
			l := &evLoop{lfd: lfd, backend: backend, conns: map[int32]*evConn{}, buf: make([]byte, 64<<10)}
			if err := l.init(); err != nil {
				return err
			}
			go l.run()
		}
		fmt.Printf("%s %s\n", ep.name, netip.AddrPortFrom(listen.Addr(), uint16(port)))
	}
	io.Copy(io.Discard, os.Stdin)
	return nil
}

func evListen(addr netip.Addr, port int) (int, int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, 0, err
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port, Addr: addr.As4()}); err != nil {
		return -1, 0, err
	}
	if err := unix.Listen(fd, 4096); err != nil {
		return -1, 0, err
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return -1, 0, err
	}
	return fd, sa.(*unix.SockaddrInet4).Port, nil
}

type evLoop struct {
	epfd, lfd int
	backend   netip.AddrPort
	conns     map[int32]*evConn
	buf       []byte // shared read buffer: bytes the destination did not take move to evConn.pending
	events    [128]unix.EpollEvent
}

// evConn: side 0 is the client, side 1 the backend; direction d reads fds[d] and writes fds[1-d].
type evConn struct {
	fds     [2]int
	pending [2][]byte // read from fds[d], not yet written to fds[1-d]
	eof     [2]bool   // fds[d] read EOF (and fds[1-d] was shut down once pending drained)
	closed  bool
}

func (l *evLoop) init() error {
	var err error
	if l.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return err
	}
	return unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, l.lfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(l.lfd)})
}

func (l *evLoop) run() {
	for {
		n, err := unix.EpollWait(l.epfd, l.events[:], -1)
		if err != nil {
			continue // EINTR
		}
		for _, ev := range l.events[:n] {
			if int(ev.Fd) == l.lfd {
				l.accept()
				continue
			}
			if c := l.conns[ev.Fd]; c != nil {
				l.pump(c)
			}
		}
	}
}

func (l *evLoop) accept() {
	for {
		nfd, _, e := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(l.lfd), 0, 0, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
		if e != 0 {
			return // EAGAIN, or an error for one connection
		}
		cfd := int(nfd)
		bfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			unix.Close(cfd)
			continue
		}
		unix.SetsockoptInt(bfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		sa := unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: l.backend.Addr().As4()}
		p := (*[2]byte)(unsafe.Pointer(&sa.Port))
		p[0], p[1] = byte(l.backend.Port()>>8), byte(l.backend.Port())
		if _, _, e := unix.RawSyscall(unix.SYS_CONNECT, uintptr(bfd), uintptr(unsafe.Pointer(&sa)), unsafe.Sizeof(sa)); e != 0 && e != unix.EINPROGRESS {
			unix.Close(cfd)
			unix.Close(bfd)
			continue
		}
		c := &evConn{fds: [2]int{cfd, bfd}}
		for _, fd := range c.fds {
			l.conns[int32(fd)] = c
			ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
			unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev)
		}
		l.pump(c) // the client's request may already be there
	}
}

// pump moves what it can both ways; edge-triggered, so it reads and writes until EAGAIN.
func (l *evLoop) pump(c *evConn) {
	for d := 0; d < 2 && !c.closed; d++ {
		src, dst := c.fds[d], c.fds[1-d]
		if !l.flush(c, d, dst) {
			continue
		}
		for !c.eof[d] && !c.closed {
			n, e := evRead(src, l.buf)
			if e == unix.EAGAIN {
				break
			}
			if e != 0 {
				l.reset(c)
				return
			}
			if n == 0 {
				c.eof[d] = true
				evShutdown(dst)
				break
			}
			c.pending[d] = l.buf[:n]
			if !l.flush(c, d, dst) {
				c.pending[d] = append([]byte(nil), c.pending[d]...) // keep what dst did not take
				break
			}
		}
	}
	if !c.closed && c.eof[0] && c.eof[1] {
		l.close(c)
	}
}

// flush writes direction d's pending bytes; false if dst would block (or the connection reset).
func (l *evLoop) flush(c *evConn, d, dst int) bool {
	for len(c.pending[d]) > 0 {
		n, e := evWrite(dst, c.pending[d])
		if e == unix.EAGAIN {
			return false
		}
		if e != 0 {
			l.reset(c)
			return false
		}
		c.pending[d] = c.pending[d][n:]
	}
	c.pending[d] = nil
	return true
}

func (l *evLoop) reset(c *evConn) {
	for _, fd := range c.fds {
		unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
	}
	l.close(c)
}

func (l *evLoop) close(c *evConn) {
	c.closed = true
	for _, fd := range c.fds {
		delete(l.conns, int32(fd))
		unix.RawSyscall(unix.SYS_CLOSE, uintptr(fd), 0, 0)
	}
}

func evRead(fd int, p []byte) (int, unix.Errno) {
	n, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), e
}

func evWrite(fd int, p []byte) (int, unix.Errno) {
	n, _, e := unix.RawSyscall6(unix.SYS_SENDTO, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)), unix.MSG_NOSIGNAL, 0, 0)
	return int(n), e
}

func evShutdown(fd int) { unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), unix.SHUT_WR, 0) }
