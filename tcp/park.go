package tcp

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// parker watches the sources of idle directions so that they need no goroutine (see splice.go). It
// owns an epoll set of its own; the set's descriptor is itself registered in the Go runtime poller,
// so the watcher goroutine sleeps in the poller like any socket reader and no thread is blocked.
// Registrations are one-shot and level-triggered: data or a FIN that arrived before arming is
// reported at once, and each wake-up starts exactly one goroutine.
type parker struct {
	f   *os.File
	raw syscall.RawConn

	mu     sync.Mutex
	dirs   map[uint64]*direction
	closed atomic.Bool

	// used by the watcher goroutine only
	events [64]unix.EpollEvent
	ready  func(fd uintptr) bool
	err    error
}

func newParker() (*parker, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("create idle watcher: %w", os.NewSyscallError("epoll_create1", err))
	}
	if err := unix.SetNonblock(epfd, true); err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("create idle watcher: %w", err)
	}
	pk := &parker{f: os.NewFile(uintptr(epfd), "idle-epoll"), dirs: make(map[uint64]*direction)}
	if pk.raw, err = pk.f.SyscallConn(); err != nil {
		pk.f.Close()
		return nil, fmt.Errorf("create idle watcher: %w", err)
	}
	pk.ready = pk.readyFn
	return pk, nil
}

// key identifies a direction in epoll event data.
func (d *direction) key() uint64 {
	k := d.c.id << 1
	if d.up {
		k |= 1
	}
	return k
}

// arm registers (or re-arms) d's source for one readability event. The caller holds d.c.mu.
func (pk *parker) arm(d *direction) error {
	key := d.key()
	op := unix.EPOLL_CTL_MOD
	if !d.armed {
		op = unix.EPOLL_CTL_ADD
		pk.mu.Lock()
		pk.dirs[key] = d
		pk.mu.Unlock()
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT, Fd: int32(key), Pad: int32(key >> 32)}
	var ctlErr error
	err := d.src.raw.Control(func(fd uintptr) {
		err := pk.raw.Control(func(epfd uintptr) {
			ctlErr = unix.EpollCtl(int(epfd), op, int(fd), &ev)
		})
		if ctlErr == nil {
			ctlErr = err
		}
	})
	if err == nil {
		err = ctlErr
	}
	if err != nil {
		return fmt.Errorf("epoll_ctl: %w", err)
	}
	d.armed = true
	return nil
}

// forget drops d from the table; the kernel drops the registration when the socket closes.
func (pk *parker) forget(d *direction) {
	if pk == nil || d.c == nil {
		return
	}
	pk.mu.Lock()
	delete(pk.dirs, d.key())
	pk.mu.Unlock()
}

// run dispatches wake-ups until close.
func (pk *parker) run(log logrus.FieldLogger) {
	for {
		pk.err = nil
		err := pk.raw.Read(pk.ready)
		if err == nil {
			err = pk.err
		}
		if err == nil {
			continue
		}
		// Close makes the read fail (poll.ErrFileClosing, not os.ErrClosed); epoll_wait on a valid
		// set fails only with EINTR, handled in readyFn. Any other error would repeat: stop, don't spin.
		if !pk.closed.Load() {
			log.WithError(err).Error("idle watcher stopped; parked connections will not wake")
		}
		return
	}
}

func (pk *parker) readyFn(epfd uintptr) bool {
	for {
		n, err := unix.EpollWait(int(epfd), pk.events[:], 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			pk.err = os.NewSyscallError("epoll_wait", err)
			return true
		}
		for _, ev := range pk.events[:n] {
			key := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			pk.mu.Lock()
			d := pk.dirs[key]
			pk.mu.Unlock()
			if d != nil {
				d.unpark()
			}
		}
		if n < len(pk.events) {
			// Drained: anything newer raises the poller's edge again.
			return false
		}
	}
}

func (pk *parker) close() {
	pk.closed.Store(true)
	pk.f.Close()
}
