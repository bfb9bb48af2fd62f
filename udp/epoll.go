package udp

import (
	"errors"
	"fmt"
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

var _ loopIO = (*epollIO)(nil)

// epollIO is a loop's I/O on epoll (loopIO): a level-triggered epoll set, waited on with a
// blocking epoll_wait while traffic flows,
// plus an eventfd that wakes the waiter when the proxy closes (closing an epoll descriptor does
// not). A blocking epoll_wait holds an OS thread; after idleAfter without events the wait moves
// into the Go netpoller instead, so an idle service port holds no thread (thousands of idle UDP
// service ports would otherwise run into the runtime's 10,000-thread limit and crash the process).
type epollIO struct {
	fd     int
	wakeFD int
	events []unix.EpollEvent
	ready  []int32 // wait's answer: the descriptors of events, but the wake eventfd's
	// file/raw are a second epoll set, registered in the Go netpoller. fd is added to it only
	// while parked: registering fd itself would make the
	// runtime's poller wake on every datagram of a busy port (measured: ~40% more CPU/exchange).
	file *os.File
	raw  syscall.RawConn
	busy bool // events came within idleAfter: wait in epoll_wait, holding the thread
}

// idleAfter is how long a wait blocks its thread before it parks in the netpoller.
const idleAfter = time.Second

func newEpollIO(maxEvents int) (*epollIO, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("eventfd", err)
	}
	p := &epollIO{fd: fd, wakeFD: wake, events: make([]unix.EpollEvent, maxEvents), ready: make([]int32, 0, maxEvents)}
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

// openWatch creates the nested epoll set the Go netpoller watches while the loop is parked.
func (p *epollIO) openWatch() error {
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

// add watches fd for datagrams.
func (p *epollIO) add(fd int) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}
	return os.NewSyscallError("epoll_ctl", unix.EpollCtl(p.fd, unix.EPOLL_CTL_ADD, fd, &ev))
}

// remove stops watching fd; it stays open.
func (p *epollIO) remove(fd int) error {
	return os.NewSyscallError("epoll_ctl del", unix.EpollCtl(p.fd, unix.EPOLL_CTL_DEL, fd, nil))
}

// wait blocks until watched sockets are readable or wake was called, and returns the readable
// ones.
func (p *epollIO) wait() ([]int32, error) {
	events, err := p.waitEvents()
	if err != nil {
		return nil, err
	}
	ready := p.ready[:0]
	for _, ev := range events {
		if int(ev.Fd) != p.wakeFD {
			ready = append(ready, ev.Fd)
		}
	}
	return ready, nil
}

// waitEvents blocks until events are ready. The wake eventfd's event is among them after wake.
func (p *epollIO) waitEvents() ([]unix.EpollEvent, error) {
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
func (p *epollIO) park() (int, error) {
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

// closeSocket closes fd, which takes it out of the epoll set.
func (p *epollIO) closeSocket(fd int) error { return closeFD(fd) }

// recvBatch readies slots [from, to) of m and reads up to to-from datagrams from fd into them
// with one recvmmsg.
func (p *epollIO) recvBatch(fd int, m *msgs, from, to int, fromListener bool) (int, error) {
	m.prepareRecv(from, to, fromListener)
	return recvmmsg(fd, m.hdrs[from:to])
}

// sendBatch sends hs from fd with one sendmmsg.
func (p *epollIO) sendBatch(fd int, hs []unix.Mmsghdr) (int, error) { return sendmmsg(fd, hs) }

// send writes one datagram to the connected socket fd.
func (p *epollIO) send(fd int, data []byte) error { return sendDatagram(fd, data) }

// wake makes a blocked or the next wait return.
func (p *epollIO) wake() {
	var one = [8]byte{1}
	_, _ = unix.Write(p.wakeFD, one[:]) // EAGAIN: the counter is already non-zero, still awake
}

// close releases the descriptors. No wait may be in progress or follow.
func (p *epollIO) close() error {
	var watch error
	if p.file != nil {
		watch = p.file.Close()
	}
	return errors.Join(watch, closeFD(p.wakeFD), closeFD(p.fd))
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

// sendDatagram writes one datagram to a connected socket.
func sendDatagram(fd int, data []byte) error {
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
