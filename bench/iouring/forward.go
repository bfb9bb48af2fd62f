// Package iouring is an experiment (issue 20, not product code): a minimal TCP forwarder on
// io_uring, to measure whether completion-based I/O (multishot accept, connect, recv/send and
// close submitted in batches, one ring per thread, no readiness round trip) closes the gap to
// nginx and HAProxy on new connections and keep-alive requests. bench/tcp runs it as the target
// "iouring" (role iouring). It grew into the product's engine (tcp/uring.go); its ring is now
// internal/iouring's, the one the engine uses.
package iouring

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	ring "github.com/kube-portal-proxy/kube-portal-proxy/internal/iouring"
)

// Operation tags in the low byte of an SQE's user_data; the rest is the connection's slot (or,
// for accept, the listener's index).
const (
	tagAccept = iota
	tagConnect
	tagRecv0 // client -> endpoint
	tagRecv1 // endpoint -> client
	tagSend0
	tagSend1
	tagClose
)

// BufSize is each direction's buffer. Per-connection buffers keep the experiment simple; a
// product version would take them from a provided-buffer ring so an idle connection holds none.
const BufSize = 16 << 10

// Route is one forwarded port: listen on Listen (port 0: any), forward to Endpoint.
type Route struct {
	Listen, Endpoint netip.AddrPort
}

// Forwarder runs one io_uring loop per thread. Each loop has its own SO_REUSEPORT listener per
// route, so the kernel spreads new connections over the loops and a connection lives on the
// thread that accepted it: no hand-off between accepting and dialing.
type Forwarder struct {
	routes  []Route
	threads int
	lns     [][]int // [thread][route] listening fds
	closed  atomic.Bool
}

// New opens the listeners (threads per route, in one reuseport group) and returns the bound
// addresses, one per route.
func New(routes []Route, threads int) (*Forwarder, []netip.AddrPort, error) {
	f := &Forwarder{routes: routes, threads: threads, lns: make([][]int, threads)}
	bound := make([]netip.AddrPort, len(routes))
	for ri, rt := range routes {
		addr := rt.Listen
		for t := range threads {
			fd, b, err := listen(addr)
			if err != nil {
				return nil, nil, fmt.Errorf("listen %s: %w", addr, err)
			}
			addr, bound[ri] = b, b
			f.lns[t] = append(f.lns[t], fd)
		}
	}
	return f, bound, nil
}

// Close stops accepting: shutting a listener down fails its multishot accept, and a loop whose
// accepts have all ended returns. Connections still open are left as they are.
func (f *Forwarder) Close() {
	f.closed.Store(true)
	for _, lns := range f.lns {
		for _, fd := range lns {
			unix.Shutdown(fd, unix.SHUT_RDWR)
		}
	}
}

// Run runs the loops, one per thread, until Close; it returns the first loop's error.
func (f *Forwarder) Run() error {
	errs := make(chan error, f.threads)
	for t := range f.threads {
		go func() {
			runtime.LockOSThread() // SINGLE_ISSUER: the thread that sets up the ring submits
			errs <- f.loop(f.lns[t])
		}()
	}
	var first error
	for range f.threads {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	for _, lns := range f.lns {
		for _, fd := range lns {
			unix.Close(fd)
		}
	}
	return first
}

func listen(addr netip.AddrPort) (int, netip.AddrPort, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, addr, os.NewSyscallError("socket", err)
	}
	for _, o := range [][3]int{{unix.SOL_SOCKET, unix.SO_REUSEADDR, 1}, {unix.SOL_SOCKET, unix.SO_REUSEPORT, 1}, {unix.IPPROTO_TCP, unix.TCP_NODELAY, 1}} {
		if err := unix.SetsockoptInt(fd, o[0], o[1], o[2]); err != nil {
			unix.Close(fd)
			return -1, addr, os.NewSyscallError("setsockopt", err)
		}
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: addr.Addr().As4(), Port: int(addr.Port())}); err != nil {
		unix.Close(fd)
		return -1, addr, os.NewSyscallError("bind", err)
	}
	if err := unix.Listen(fd, 65535); err != nil {
		unix.Close(fd)
		return -1, addr, os.NewSyscallError("listen", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		unix.Close(fd)
		return -1, addr, err
	}
	in := sa.(*unix.SockaddrInet4)
	return fd, netip.AddrPortFrom(netip.AddrFrom4(in.Addr), uint16(in.Port)), nil
}

// conn is one proxied connection, owned by one loop. Sockets are blocking: io_uring tries each
// operation without blocking and, if it would block, waits for readiness inside the kernel.
type conn struct {
	cfd, bfd  int32
	sa        unix.RawSockaddrInet4 // endpoint, read by the kernel when the connect is issued
	buf       [2][]byte
	n, off    [2]int  // bytes in buf, bytes of them sent
	eof       [2]bool // direction saw EOF and its FIN was forwarded (or is being)
	connected bool
	held      bool // client bytes received before the connect completed
	failed    bool // torn down: start nothing new, close once nothing is in flight
	closing   bool // close submitted
	inflight  int  // SQEs not yet completed
}

type loop struct {
	r      *ring.Ring
	routes []Route
	lns    []int
	conns  []*conn
	free   []uint32
	bufs   [][]byte // buffers of closed connections, for the next ones (no garbage per connection)

	closed    *atomic.Bool
	accepting int // listeners with an accept armed
}

func (l *loop) getBuf() []byte {
	if n := len(l.bufs); n > 0 {
		b := l.bufs[n-1]
		l.bufs = l.bufs[:n-1]
		return b
	}
	return make([]byte, BufSize)
}

func (f *Forwarder) loop(lns []int) error {
	r, err := ring.New(4096)
	if err != nil {
		return err
	}
	defer r.Close()
	l := &loop{r: r, routes: f.routes, lns: lns, closed: &f.closed, accepting: len(lns)}
	for i := range lns {
		l.armAccept(i)
	}
	for l.accepting > 0 {
		// Submit everything queued and wait for at least one completion.
		if err := r.Enter(1); err != nil {
			return err
		}
		r.Reap(l.complete)
	}
	return nil
}

func (l *loop) armAccept(i int) {
	s := l.r.Get()
	s.Opcode, s.Fd, s.Ioprio = ring.OpAccept, int32(l.lns[i]), ring.AcceptMultishot
	s.OpFlags = unix.SOCK_CLOEXEC
	s.UserData = uint64(i)<<8 | tagAccept
}

func (l *loop) complete(c *ring.CQE) {
	tag, id := int(c.UserData&0xff), uint32(c.UserData>>8)
	if tag == tagAccept {
		if c.Flags&ring.CqeFMore == 0 { // the multishot accept ended: re-arm it, unless closing
			if l.closed.Load() {
				l.accepting--
				return
			}
			l.armAccept(int(id))
		}
		if c.Res >= 0 {
			l.accepted(int(id), c.Res)
		}
		return
	}
	cn := l.conns[id]
	cn.inflight--
	switch tag {
	case tagConnect:
		l.connected(id, cn, c.Res)
	case tagRecv0, tagRecv1:
		l.received(id, cn, tag-tagRecv0, c.Res)
	case tagSend0, tagSend1:
		l.sent(id, cn, tag-tagSend0, c.Res)
	}
	if cn.inflight == 0 {
		switch {
		case !cn.closing && cn.eof[0] && cn.eof[1]:
			l.closeConn(id, cn)
		case cn.closing && cn.cfd < 0 && cn.bfd < 0:
			l.conns[id] = nil
			l.free = append(l.free, id)
			l.bufs = append(l.bufs, cn.buf[0], cn.buf[1])
		}
	}
}

func (l *loop) accepted(route int, cfd int32) {
	bfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		unix.Close(int(cfd))
		return
	}
	unix.SetsockoptInt(bfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	cn := &conn{cfd: cfd, bfd: int32(bfd)}
	cn.buf[0], cn.buf[1] = l.getBuf(), l.getBuf()
	ep := l.routes[route].Endpoint
	cn.sa = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: ep.Addr().As4()}
	p := (*[2]byte)(unsafe.Pointer(&cn.sa.Port))
	p[0], p[1] = byte(ep.Port()>>8), byte(ep.Port())
	var id uint32
	if n := len(l.free); n > 0 {
		id, l.free = l.free[n-1], l.free[:n-1]
		l.conns[id] = cn
	} else {
		id = uint32(len(l.conns))
		l.conns = append(l.conns, cn)
	}
	s := l.r.Get()
	s.Opcode, s.Fd = ring.OpConnect, cn.bfd
	s.Addr, s.Off = uint64(uintptr(unsafe.Pointer(&cn.sa))), uint64(unsafe.Sizeof(cn.sa))
	s.UserData = uint64(id)<<8 | tagConnect
	cn.inflight++
	l.recv(id, cn, 0) // the client's first bytes, in parallel with the connect
}

func (l *loop) fds(cn *conn, dir int) (src, dst int32) {
	if dir == 0 {
		return cn.cfd, cn.bfd
	}
	return cn.bfd, cn.cfd
}

func (l *loop) recv(id uint32, cn *conn, dir int) {
	src, _ := l.fds(cn, dir)
	s := l.r.Get()
	s.Opcode, s.Fd = ring.OpRecv, src
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&cn.buf[dir][0]))), BufSize
	s.UserData = uint64(id)<<8 | uint64(tagRecv0+dir)
	cn.inflight++
}

func (l *loop) send(id uint32, cn *conn, dir int) {
	_, dst := l.fds(cn, dir)
	s := l.r.Get()
	s.Opcode, s.Fd = ring.OpSend, dst
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&cn.buf[dir][cn.off[dir]]))), uint32(cn.n[dir]-cn.off[dir])
	s.OpFlags = unix.MSG_NOSIGNAL
	s.UserData = uint64(id)<<8 | uint64(tagSend0+dir)
	cn.inflight++
}

// shutdown forwards a FIN with a direct system call: the kernel never runs IORING_OP_SHUTDOWN
// inline (io_shutdown refuses the non-blocking issue), so every one went to an io-wq worker
// thread, a wake-up and a thread hand-off per connection (3.7% + 3.4% of the samples in the
// iou-wrk threads, perf, bench/tcp conn test).
func (l *loop) shutdown(id uint32, cn *conn, dir int) {
	_, dst := l.fds(cn, dir)
	if err := unix.Shutdown(int(dst), unix.SHUT_WR); err != nil {
		l.fail(id, cn)
	}
}

func (l *loop) connected(id uint32, cn *conn, res int32) {
	if res < 0 || cn.failed || cn.closing {
		l.fail(id, cn)
		return
	}
	cn.connected = true
	l.recv(id, cn, 1)
	if cn.held {
		cn.held = false
		l.forward(id, cn, 0)
	}
}

func (l *loop) received(id uint32, cn *conn, dir int, res int32) {
	switch {
	case cn.closing || cn.failed:
	case res < 0:
		l.fail(id, cn)
	case dir == 0 && !cn.connected:
		cn.n[0], cn.off[0], cn.held = int(res), 0, true
	default:
		cn.n[dir], cn.off[dir] = int(res), 0
		l.forward(id, cn, dir)
	}
}

// forward sends what dir received, or forwards its EOF.
func (l *loop) forward(id uint32, cn *conn, dir int) {
	if cn.n[dir] == 0 {
		cn.eof[dir] = true
		if !cn.eof[1-dir] {
			l.shutdown(id, cn, dir)
		} // else both saw EOF: closing sends this FIN too
		return
	}
	l.send(id, cn, dir)
}

func (l *loop) sent(id uint32, cn *conn, dir int, res int32) {
	switch {
	case cn.closing || cn.failed:
	case res < 0:
		l.fail(id, cn)
	case cn.off[dir]+int(res) < cn.n[dir]:
		cn.off[dir] += int(res)
		l.send(id, cn, dir)
	default:
		l.recv(id, cn, dir)
	}
}

// fail tears a connection down: shutting both sockets down completes the operations still in
// flight on them (a recv returns 0), after which the last completion closes them.
func (l *loop) fail(id uint32, cn *conn) {
	if cn.closing || cn.failed {
		return
	}
	cn.eof = [2]bool{true, true}
	if cn.inflight == 0 {
		l.closeConn(id, cn)
		return
	}
	cn.failed = true
	unix.Shutdown(int(cn.cfd), unix.SHUT_RDWR)
	unix.Shutdown(int(cn.bfd), unix.SHUT_RDWR)
}

func (l *loop) closeConn(id uint32, cn *conn) {
	cn.closing = true
	for _, fd := range []int32{cn.cfd, cn.bfd} {
		s := l.r.Get()
		s.Opcode, s.Fd = ring.OpClose, fd
		s.UserData = uint64(id)<<8 | tagClose
		cn.inflight++
	}
	cn.cfd, cn.bfd = -1, -1
}
