package tcp

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/iouring"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// The io_uring engine. A few loops (one per P by default), each on a locked OS thread with a ring
// of its own, serve every proxy sharing the engine: each loop has an accept armed on every
// listening socket, and a connection lives on the loop that accepted it. Everything a round of
// completions starts is submitted, and the next completions waited for, in one io_uring_enter.
//
// Why single-shot accepts, not multishot: io_uring's accept waits on the listener exclusively,
// and the kernel wakes the first exclusive waiter in the queue. A multishot accept never leaves
// the queue, so the loop that armed first got every connection (bench/tcp: one loop thread with
// 95% of the CPU, the other idle, and connection rates below the epoll engine's in bench/suite).
// A single-shot accept is re-armed at the tail after each connection, so the loops take turns;
// and it returns the client's address, which a multishot accept cannot (one getpeername less).
//
// A connection on a loop:
//   - accepted: Allow, then the shared pick (conn.go); a pick that finds nothing
//     with a hold configured waits on a goroutine (hold.go) and comes back to the loop;
//   - dialed: socket(2), then IORING_OP_CONNECT linked to an IORING_OP_LINK_TIMEOUT of the
//     attempt's timeout; a failed attempt goes down the ladder (conn.attemptFailed);
//   - the PROXY header, if any, sent before anything else;
//   - each direction: a recv that selects its buffer from the loop's provided-buffer ring when
//     data arrives (an idle connection holds two armed recvs and no buffer), then a send of it;
//     a recv that fills a whole buffer means a bulk burst, which is spliced through a pooled pipe
//     with non-blocking splice(2) calls until the source runs dry (zero copy), waiting for
//     writability with IORING_OP_POLL_ADD;
//   - EOF: shutdown(SHUT_WR) of the other socket, as the epoll engine does (IORING_OP_SHUTDOWN
//     always goes to an io-wq worker thread: bench/RESULTS.md);
//   - ended (both EOFs, an error, or terminate from any goroutine: Shutdown, DropEndpoint, the
//     idle sweep): SO_LINGER 0 if it is a reset, every request on its sockets cancelled, then
//     closed once the last completion is in, and the shared accounting runs (conn.finish).
//
// Other goroutines reach a loop through its inbox, a list of functions the loop runs between
// rounds, and an eventfd that wakes it when it waits in the kernel.

// Tags in the low byte of an SQE's user_data; the rest is a slot in the loop's tables.
const (
	tagWake = iota
	tagAccept
	tagAcceptCancel
	tagConnect
	tagConnectTimeout
	tagHeader
	tagRecvUp // recv, send, poll: +0 client->endpoint, +1 endpoint->client
	tagRecvDown
	tagSendUp
	tagSendDown
	tagPollUp
	tagPollDown
	tagCancel
)

const (
	ringEntries = 1024
	// uringBufs buffers of bufSize per loop. Each connection's direction holds one only from the
	// recv that filled it until its send completes. The kernel hands the buffers out in ring order,
	// so all of them end up resident: 2 MiB per loop. When all are taken (as many slow readers),
	// a direction waits for readability with a poll and reads into a pooled buffer of its own
	// (udir.readOwn), so no connection waits for another's reader.
	uringBufs = 128
)

type uringEngine struct {
	threads int
	// spareP: the engine raises GOMAXPROCS by one while it runs (see start).
	spareP    bool
	prevProcs int
	ringBufs  int // buffers per loop; 0 means uringBufs (tests make it small)

	startOnce sync.Once
	startErr  error
	mu        sync.Mutex
	closed    bool
	loops     []*loop
	wg        sync.WaitGroup
}

func (e *uringEngine) Name() string           { return EngineIOUring }
func (e *uringEngine) blockingListener() bool { return true }

// start sets up the loops on first use.
func (e *uringEngine) start() error {
	e.startOnce.Do(func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.closed {
			e.startErr = errEngineClosed
			return
		}
		// The loops' back-off timers need the runtime poller (timers wake through it). A process
		// whose only sockets are the engine's has not set it up yet, and setting it up later
		// fails fatally when descriptors are short (netpollinit's epoll_create): the moment a
		// back-off timer is first armed. So set it up now with a timer that never fires.
		time.AfterFunc(time.Hour, func() {}).Stop()
		// A loop waits for completions in io_uring_enter, a system call. When every P is held by a
		// thread in a system call, sysmon takes a P from a waiting loop after 20 µs and hands it
		// to another thread (a futex wake-up, and the way back when the loop wakes), on every
		// wait: 8-14% of the CPU in bench/iouring's profiles. With one P more than loops, a P is
		// idle, and sysmon leaves Ps in system calls alone for 10 ms; the loops' threads mostly
		// wait in the kernel, so the extra P costs no CPU of its own.
		if e.spareP {
			e.prevProcs = runtime.GOMAXPROCS(0)
			runtime.GOMAXPROCS(e.prevProcs + 1)
		}
		ready := make(chan error, e.threads)
		for range e.threads {
			l := &loop{nbufs: e.ringBufs}
			if l.nbufs == 0 {
				l.nbufs = uringBufs
			}
			e.loops = append(e.loops, l)
			e.wg.Add(1)
			go func() {
				defer e.wg.Done()
				// The thread stays locked: it exits with the goroutine, and the ring with it.
				runtime.LockOSThread()
				l.run(ready)
			}()
		}
		for range e.threads {
			if err := <-ready; err != nil && e.startErr == nil {
				e.startErr = err
			}
		}
		if e.startErr != nil {
			for _, l := range e.loops {
				l.post(func() { l.stopping = true })
			}
		}
	})
	return e.startErr
}

// Close stops the loops; connections still open on them are closed without accounting.
func (e *uringEngine) Close() error {
	e.mu.Lock()
	e.closed = true
	loops := e.loops
	e.mu.Unlock()
	for _, l := range loops {
		l.post(func() { l.stopping = true })
	}
	e.wg.Wait()
	e.mu.Lock()
	if e.prevProcs > 0 {
		runtime.GOMAXPROCS(e.prevProcs)
		e.prevProcs = 0
	}
	e.mu.Unlock()
	return nil
}

// acceptLoop arms an accept on every loop for the proxy's listening socket, and again whenever
// SetRefusing replaces it, until the proxy is closed. The loops do the accepting.
func (e *uringEngine) acceptLoop(p *Proxy) error {
	if err := e.start(); err != nil {
		return fmt.Errorf("tcp proxy %s: start the io_uring engine: %w", p.name, err)
	}
	for {
		p.lnMu.Lock()
		ln, changed := p.ln, p.lnChanged
		if ln != nil && p.uacceptLn != ln {
			// Armed under lnMu: Close and SetRefusing cancel what is armed before closing ln, so
			// an accept is never armed on a closed (and maybe reused) descriptor.
			var fd int
			_ = ln.raw.Control(func(f uintptr) { fd = int(f) })
			accs := make([]*uaccept, len(e.loops))
			for i, l := range e.loops {
				a := &uaccept{p: p, fd: int32(fd), done: make(chan struct{})}
				accs[i] = a
				if !l.post(func() { l.armAccept(a) }) {
					close(a.done)
				}
			}
			p.uaccepts, p.uacceptLn = accs, ln
		}
		p.lnMu.Unlock()
		select {
		case <-changed:
		case <-p.closed:
			return nil
		}
	}
}

// stopAccepting cancels the accepts armed on ln and waits for the loops to confirm. The caller
// holds p.lnMu (the loops never take it).
func (e *uringEngine) stopAccepting(p *Proxy, ln *sock) {
	if p.uacceptLn != ln {
		return
	}
	accs := p.uaccepts
	p.uaccepts, p.uacceptLn = nil, nil
	for i, a := range accs {
		l := e.loops[i]
		if !l.post(func() { l.cancelAccept(a) }) {
			a.finish()
		}
	}
	for _, a := range accs {
		<-a.done
	}
}

// uaccept is the accept of one proxy's listening socket on one loop.
type uaccept struct {
	p         *Proxy
	fd        int32
	slot      uint32
	sa        unix.RawSockaddrInet6 // the client's address, written by the kernel
	salen     uint32
	armed     bool // an accept is in the kernel
	cancelled bool
	backoff   time.Duration
	doneOnce  sync.Once
	done      chan struct{} // closed once cancelled and nothing is armed
}

func (a *uaccept) finish() { a.doneOnce.Do(func() { close(a.done) }) }

// loop is one ring and what it serves. Everything but the inbox is the loop thread's own.
type loop struct {
	r     *iouring.Ring
	bufs  *iouring.BufRing
	nbufs int
	efd   int
	efdv  [8]byte

	inMu     sync.Mutex
	inbox    []func()
	spare    []func()
	dead     bool // the loop has stopped: posts are refused
	sleeping atomic.Bool

	stopping bool
	reap     func(*iouring.CQE) // l.complete, bound once: no allocation per round
	conns    []*uconn
	free     []uint32
	accepts  []*uaccept
	freeAcc  []uint32
}

// post queues f to run on the loop; false if the loop has stopped.
func (l *loop) post(f func()) bool {
	l.inMu.Lock()
	if l.dead {
		l.inMu.Unlock()
		return false
	}
	l.inbox = append(l.inbox, f)
	l.inMu.Unlock()
	if l.sleeping.Swap(false) {
		one := uint64(1)
		unix.Write(l.efd, (*[8]byte)(unsafe.Pointer(&one))[:])
	}
	return true
}

func (l *loop) run(ready chan<- error) {
	err := l.setup()
	ready <- err
	if err != nil {
		l.inMu.Lock()
		l.dead = true
		l.inMu.Unlock()
		return
	}
	defer l.teardown()
	for !l.stopping {
		l.runInbox()
		if l.stopping {
			return
		}
		l.sleeping.Store(true)
		l.inMu.Lock()
		queued := len(l.inbox) > 0
		l.inMu.Unlock()
		wait := uint32(1)
		if queued {
			l.sleeping.Store(false)
			wait = 0
		}
		if err := l.r.Enter(wait); err != nil {
			// Only a broken ring fails here (EFAULT, EBADF); nothing on it can progress.
			fmt.Fprintf(os.Stderr, "tcp: io_uring loop stopped: %v\n", err)
			return
		}
		l.sleeping.Store(false)
		l.r.Reap(l.reap)
	}
}

func (l *loop) setup() error {
	r, err := iouring.New(ringEntries)
	if err != nil {
		return err
	}
	bufs, err := r.NewBufRing(1, l.nbufs, bufSize)
	if err != nil {
		r.Close()
		return err
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		bufs.Close()
		r.Close()
		return os.NewSyscallError("eventfd", err)
	}
	l.r, l.bufs, l.efd, l.reap = r, bufs, efd, l.complete
	l.armWake()
	return nil
}

// teardown closes what is left. The engine is closed after the proxies, which end their
// connections first; a connection still open here is closed and ends as if its peers had gone, so
// that no Shutdown waits for it.
func (l *loop) teardown() {
	l.inMu.Lock()
	l.dead = true
	l.inMu.Unlock()
	l.runInbox() // cancel requests queued before dead: their waiters must hear back
	for _, a := range l.accepts {
		if a != nil {
			a.finish()
		}
	}
	l.r.Close() // cancels every request: descriptors are free to close
	for _, u := range l.conns {
		if u != nil && u.inflight >= 0 {
			u.closing = true
			u.inflight = 0
			u.closeNow()
		}
	}
	l.bufs.Close()
	unix.Close(l.efd)
}

func (l *loop) runInbox() {
	l.inMu.Lock()
	fs := l.inbox
	l.inbox = l.spare[:0]
	l.inMu.Unlock()
	for i, f := range fs {
		f()
		fs[i] = nil
	}
	l.spare = fs
}

func (l *loop) armWake() {
	s := l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpPollAdd, int32(l.efd), unix.POLLIN
	s.UserData = tagWake
}

func userData(slot uint32, tag int) uint64 { return uint64(slot)<<8 | uint64(tag) }

func (l *loop) complete(c *iouring.CQE) {
	tag, slot := int(c.UserData&0xff), uint32(c.UserData>>8)
	switch tag {
	case tagWake:
		unix.Read(l.efd, l.efdv[:])
		l.armWake()
		return
	case tagAccept:
		l.accepted(slot, c)
		return
	case tagAcceptCancel:
		return
	}
	u := l.conns[slot]
	u.inflight--
	switch tag {
	case tagRecvUp, tagRecvDown:
		u.d[tag-tagRecvUp].linkedSendDone()
	case tagSendUp, tagSendDown:
		if d := &u.d[tag-tagSendUp]; d.linked {
			// A linked send reports only a failure; its recv is then cancelled.
			d.linked, d.sendFailed = false, true
			d.count(-int64(d.n - max(int(c.Res), 0)))
			if !u.closing {
				u.c.legFailed(d.i == 0, true, sendError(c.Res))
			}
			tag = -1 // handled
		}
	}
	if u.closing {
		if c.Flags&iouring.CqeFBuffer != 0 {
			l.releaseBuf(uint16(c.Flags >> 16))
		}
	} else {
		switch tag {
		case tagConnect:
			u.connected(c.Res)
		case tagHeader:
			u.headerSent(c.Res)
		case tagRecvUp, tagRecvDown:
			u.d[tag-tagRecvUp].received(c.Res, c.Flags)
		case tagSendUp, tagSendDown:
			u.d[tag-tagSendUp].sent(c.Res)
		case -1:
		case tagPollUp, tagPollDown:
			u.d[tag-tagPollUp].polled()
		}
	}
	if u.closing && u.inflight == 0 {
		u.closeNow()
	}
}

// --- accepting

func (l *loop) armAccept(a *uaccept) {
	if a.cancelled || a.armed || l.stopping {
		return
	}
	if n := len(l.freeAcc); n > 0 {
		a.slot, l.freeAcc = l.freeAcc[n-1], l.freeAcc[:n-1]
		l.accepts[a.slot] = a
	} else {
		a.slot = uint32(len(l.accepts))
		l.accepts = append(l.accepts, a)
	}
	a.salen = uint32(unsafe.Sizeof(a.sa))
	s := l.r.Get()
	s.Opcode, s.Fd = iouring.OpAccept, a.fd
	s.Addr, s.Off = uint64(uintptr(unsafe.Pointer(&a.sa))), uint64(uintptr(unsafe.Pointer(&a.salen)))
	s.OpFlags = unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC
	s.UserData = userData(a.slot, tagAccept)
	a.armed = true
}

func (l *loop) cancelAccept(a *uaccept) {
	a.cancelled = true
	if !a.armed {
		a.finish()
		return
	}
	s := l.r.Get()
	s.Opcode, s.Addr = iouring.OpAsyncCancel, userData(a.slot, tagAccept)
	s.UserData = userData(a.slot, tagAcceptCancel)
}

func (l *loop) accepted(slot uint32, c *iouring.CQE) {
	a := l.accepts[slot]
	if c.Flags&iouring.CqeFMore == 0 {
		a.armed = false
		l.accepts[slot] = nil
		l.freeAcc = append(l.freeAcc, slot)
	}
	p := a.p
	switch {
	case c.Res >= 0:
		a.backoff = 0
		peer, _ := sockopt.ParseRaw(&a.sa)
		l.serve(p, int(c.Res), peer)
	case c.Res == -int32(unix.ECANCELED):
	default:
		errno := syscall.Errno(-c.Res)
		err := os.NewSyscallError("accept", errno)
		switch {
		case outOfResources(err):
			a.backoff = nextBackoff(a.backoff)
			p.logger().WithError(err).WithField("backoff", a.backoff).Warn("accept: out of resources, backing off")
		case errno == unix.ECONNABORTED || errno == unix.EPERM || errno == unix.EPROTO || errno == unix.EINTR || errno == unix.EAGAIN:
			// These concern one connection; the listener is fine.
			p.logger().WithError(err).Debug("accept failed")
		default:
			// The listener itself is failing (the epoll engine's Run would return): retrying
			// at once would spin, so retry at the back-off's pace, and say so.
			a.backoff = nextBackoff(a.backoff)
			p.logger().WithError(err).WithField("backoff", a.backoff).Error("accept on the proxy socket failed")
		}
	}
	if a.armed {
		return
	}
	switch {
	case a.cancelled:
		a.finish()
	case a.backoff > 0 && c.Res < 0:
		// The listener stays readable while descriptors are short: re-arming at once would spin.
		time.AfterFunc(a.backoff, func() { l.post(func() { l.armAccept(a) }) })
	default:
		l.armAccept(a)
	}
}

// serve starts a connection accepted on the loop.
func (l *loop) serve(p *Proxy, fd int, peer netip.AddrPort) {
	if p.cfg.Allow != nil && !p.cfg.Allow(peer.Addr()) {
		p.deny(fd, peer)
		return
	}
	u := &uconn{l: l, fd: [2]int32{int32(fd), -1}}
	u.d[0] = udir{u: u, i: 0, buf: -1}
	u.d[1] = udir{u: u, i: 1, buf: -1}
	if n := len(l.free); n > 0 {
		u.slot, l.free = l.free[n-1], l.free[:n-1]
		l.conns[u.slot] = u
	} else {
		u.slot = uint32(len(l.conns))
		l.conns = append(l.conns, u)
	}
	c := p.newConn(peer, u)
	c.up.c, c.up.up, c.down.c = c, true, c // the directions count bytes (direction.count)
	p.wg.Add(1)
	u.pick()
}

// --- a connection

// uconn is the io_uring engine's part of a connection; the loop's own.
type uconn struct {
	c        *conn
	l        *loop
	slot     uint32
	fd       [2]int32 // client, endpoint; -1 none
	inflight int      // requests in the kernel, plus a hold or back-off under way
	closing  bool     // terminate reached the loop: requests cancelled, nothing new starts

	// the dial ladder
	attempt  int
	reset    bool
	lastErr  error
	ep       netip.AddrPort
	deadline time.Time
	backoff  time.Duration
	sa       unix.RawSockaddrInet6
	salen    uint32
	ts       unix.Timespec

	hdr []byte // the PROXY header while it is sent

	d [2]udir // client->endpoint, endpoint->client
}

// terminate asks the loop to close the connection (conn.terminate, from any goroutine).
func (u *uconn) terminate(rst bool) {
	u.l.post(func() { u.close(rst) })
}

// drain sends FIN to both peers (conn.drain).
func (u *uconn) drain() {
	u.l.post(func() {
		if !u.closing {
			for _, fd := range u.fd {
				if fd >= 0 {
					_ = sysShutdownWrite(int(fd))
				}
			}
		}
	})
}

func (u *uconn) close(rst bool) {
	if u.closing {
		return
	}
	u.closing = true
	for _, fd := range u.fd {
		if fd < 0 {
			continue
		}
		if rst {
			sysLingerZero(int(fd))
		}
		if u.inflight > 0 {
			s := u.l.r.Get()
			s.Opcode, s.Fd, s.OpFlags = iouring.OpAsyncCancel, fd, iouring.CancelFD|iouring.CancelAll
			s.UserData = userData(u.slot, tagCancel)
			u.inflight++
		}
	}
	if u.inflight == 0 {
		u.closeNow()
	}
}

// closeNow runs once nothing of the connection is in the kernel: close, account, free the slot.
func (u *uconn) closeNow() {
	l := u.l
	for i := range u.d {
		d := &u.d[i]
		if d.buf >= 0 {
			l.releaseBuf(uint16(d.buf))
			d.buf = -1
		}
		if d.pipe != nil {
			pipes.put(d.pipe, d.pn == 0)
			d.pipe = nil
		}
		if d.own != nil {
			bufs.Put(d.own)
			d.own = nil
		}
	}
	for i, fd := range u.fd {
		if fd >= 0 {
			sysClose(int(fd))
			u.fd[i] = -1
		}
	}
	l.conns[u.slot] = nil
	l.free = append(l.free, u.slot)
	u.inflight = -1 // never again
	c := u.c
	c.release()
	c.p.wg.Done()
}

// pick asks the picker for the endpoint of the next attempt.
func (u *uconn) pick() {
	c := u.c
	p := c.p
	if len(p.cfg.DialTimeouts) == 0 {
		c.fail(flow.DialFailed, dialsFailed(nil))
		return
	}
	ep, err := p.picker.Next(c.clientAddr.Addr(), u.reset)
	if err == nil {
		u.dial(ep)
		return
	}
	if u.attempt > 0 {
		c.fail(flow.DialFailed, dialsFailed(u.lastErr))
		return
	}

	if p.cfg.HoldTimeout <= 0 {
		_, reason, err := c.hold(err) // no hold: returns at once
		c.fail(reason, err)
		return
	}
	// The hold waits on channels: a goroutine of its own, back to the loop when it is over.
	u.inflight++
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ep, reason, err := c.hold(err)
		if !u.l.post(func() { u.held(ep, reason, err) }) {
			c.fail(reason, errEngineClosed)
		}
	}()
}

func (u *uconn) held(ep netip.AddrPort, reason flow.EndReason, err error) {
	u.inflight--
	if u.closing {
		if u.inflight == 0 {
			u.closeNow()
		}
		return
	}
	if err != nil {
		u.c.fail(reason, err)
		return
	}
	u.dial(ep)
}

// dial starts an attempt to ep: a non-blocking socket, then the connect with its timeout.
func (u *uconn) dial(ep netip.AddrPort) {
	c := u.c
	timeout := c.p.cfg.DialTimeouts[u.attempt]
	if u.backoff == 0 {
		c.attempt(ep, u.attempt)
		u.ep, u.deadline = ep, time.Now().Add(timeout)
	}
	fd, err := unix.Socket(sockopt.Family(ep.Addr()), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		err = os.NewSyscallError("socket", err)
	} else if err = setLegOptions(fd, c.p.cfg.KeepAlive); err != nil {
		unix.Close(fd)
	}
	if err != nil {
		if outOfResources(err) && u.backOff(err) {
			return
		}
		u.backoff = 0
		u.failed(timeout, err)
		return
	}
	u.backoff = 0
	u.fd[1] = int32(fd)
	a := ep.Addr().Unmap()
	if a.Is4() {
		sa := (*unix.RawSockaddrInet4)(unsafe.Pointer(&u.sa))
		*sa = unix.RawSockaddrInet4{Family: unix.AF_INET, Port: sockopt.Htons(ep.Port()), Addr: a.As4()}
		u.salen = unix.SizeofSockaddrInet4
	} else {
		u.sa = unix.RawSockaddrInet6{Family: unix.AF_INET6, Port: sockopt.Htons(ep.Port()), Addr: a.As16()}
		u.salen = unix.SizeofSockaddrInet6
	}
	u.ts = unix.NsecToTimespec(int64(time.Until(u.deadline)))
	// The kernel copies the address and the timeout when it takes the SQEs (io_uring_enter), and
	// u lives until every completion is in.
	s := u.l.r.Get()
	s.Opcode, s.Fd, s.Flags = iouring.OpConnect, int32(fd), iouring.SqeIOLink
	s.Addr, s.Off = uint64(uintptr(unsafe.Pointer(&u.sa))), uint64(u.salen)
	s.UserData = userData(u.slot, tagConnect)
	t := u.l.r.Get()
	t.Opcode, t.Addr, t.Len = iouring.OpLinkTimeout, uint64(uintptr(unsafe.Pointer(&u.ts))), 1
	t.UserData = userData(u.slot, tagConnectTimeout)
	u.inflight += 2
}

// backOff retries a dial that found no descriptor after a pause, while the attempt's time lasts
// (see conn.dialBackingOff); false when there is no time left.
func (u *uconn) backOff(err error) bool {
	u.backoff = nextBackoff(u.backoff)
	if time.Until(u.deadline) < u.backoff {
		return false
	}
	if u.backoff == minBackoff {
		u.c.logger().WithError(err).Warn("dial: out of resources, backing off")
	}
	u.inflight++
	ep := u.ep
	time.AfterFunc(u.backoff, func() {
		u.l.post(func() {
			u.inflight--
			if u.closing {
				if u.inflight == 0 {
					u.closeNow()
				}
				return
			}
			u.dial(ep)
		})
	})
	return true
}

// failed goes down the ladder after a failed attempt.
func (u *uconn) failed(timeout time.Duration, err error) {
	c := u.c
	lastErr, stop := c.attemptFailed(u.ep, u.attempt, timeout, err)
	if stop {
		c.fail(flow.Shutdown, err)
		return
	}
	u.lastErr = lastErr
	u.attempt++
	u.reset = true
	if u.attempt == len(c.p.cfg.DialTimeouts) {
		c.fail(flow.DialFailed, dialsFailed(lastErr))
		return
	}
	u.pick()
}

func (u *uconn) connected(res int32) {
	c := u.c
	if res < 0 {
		sysClose(int(u.fd[1])) // nothing else is in flight on it: the timeout has no descriptor
		u.fd[1] = -1
		var err error = os.NewSyscallError("connect", syscall.Errno(-res))
		if res == -int32(unix.ECANCELED) { // the linked timeout fired
			err = fmt.Errorf("connect: %w", os.ErrDeadlineExceeded)
		}
		u.failed(c.p.cfg.DialTimeouts[u.attempt], err)
		return
	}
	c.observed(u.ep, nil)
	if v := c.p.cfg.ProxyProtocol; v != proxyprotocol.Off {
		u.hdr = c.proxyHeader(make([]byte, 0, proxyprotocol.MaxLen), int(u.fd[0]), v)
		u.sendHeader()
		return
	}
	u.established()
}

func (u *uconn) sendHeader() {
	s := u.l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpSend, u.fd[1], unix.MSG_NOSIGNAL
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&u.hdr[0]))), uint32(len(u.hdr))
	s.UserData = userData(u.slot, tagHeader)
	u.inflight++
}

func (u *uconn) headerSent(res int32) {
	if res < 0 {
		u.c.fail(flow.EndpointReset, fmt.Errorf("send the PROXY protocol header: %w", os.NewSyscallError("send", syscall.Errno(-res))))
		return
	}
	if u.hdr = u.hdr[res:]; len(u.hdr) > 0 {
		u.sendHeader()
		return
	}
	u.hdr = nil
	u.established()
}

// established starts both directions.
func (u *uconn) established() {
	c := u.c
	c.mu.Lock()
	c.est = true
	c.mu.Unlock()
	u.d[0].recv()
	u.d[1].recv()
}

// --- a direction

// udir moves bytes one way: fd[i] -> fd[1-i].
type udir struct {
	u      *uconn
	i      int
	buf    int32 // the provided buffer held, -1 none
	n, off int   // bytes in it, bytes of them sent
	bulk   bool
	pipe   *pipe
	pn     int            // bytes in the pipe
	nobuf  bool           // the buffer ring was empty: wait with a poll, read into own
	own    *[bufSize]byte // a pooled buffer being sent, instead of the ring's
	// linked: a send of buf is in flight with the next recv linked behind it (sendThenRecv);
	// sendFailed: that send posted its failure.
	linked, sendFailed bool
}

func (d *udir) src() int32 { return d.u.fd[d.i] }
func (d *udir) dst() int32 { return d.u.fd[1-d.i] }

func (d *udir) recv() {
	l := d.u.l
	s := l.r.Get()
	s.Opcode, s.Fd, s.Flags = iouring.OpRecv, d.src(), iouring.SqeBufferSelect
	s.BufGroup, s.Len = l.bufs.Group(), uint32(bufSize)
	s.UserData = userData(d.u.slot, tagRecvUp+d.i)
	d.u.inflight++
}

func (d *udir) received(res int32, flags uint32) {
	u := d.u
	if res <= 0 && flags&iouring.CqeFBuffer != 0 { // not expected, but a buffer lost is lost for good
		u.l.releaseBuf(uint16(flags >> 16))
	}
	switch {
	case res == -int32(unix.ENOBUFS):
		// Every buffer of the ring is moving data.
		d.nobuf = true
		d.poll(d.src(), unix.POLLIN)
	case res < 0:
		u.c.legFailed(d.i == 0, false, os.NewSyscallError("recv", syscall.Errno(-res)))
	case res == 0:
		d.eof()
	default:
		d.buf, d.n, d.off = int32(flags>>16), int(res), 0
		d.bulk = int(res) == bufSize
		if d.bulk {
			d.send()
			return
		}
		d.sendThenRecv()
	}
}

// sendThenRecv sends the buffer and, linked behind it, the next recv, in one submission. The
// send waits until all of it is sent (MSG_WAITALL) and posts no completion when it succeeds
// (IOSQE_CQE_SKIP_SUCCESS): the next recv's completion says it did, so a request costs one
// io_uring_enter per direction instead of two (the send's completion would end the wait at once).
// A send that fails posts its completion, and the linked recv is cancelled.
func (d *udir) sendThenRecv() {
	l := d.u.l
	b := l.bufs.Buf(uint16(d.buf))
	s := l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpSend, d.dst(), unix.MSG_NOSIGNAL|unix.MSG_WAITALL
	s.Flags = iouring.SqeIOLink | iouring.SqeCQESkipSuccess
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&b[0]))), uint32(d.n)
	s.UserData = userData(d.u.slot, tagSendUp+d.i)
	d.u.inflight++
	d.linked, d.sendFailed = true, false
	// Counted now: no completion will say when it is sent. A failed send takes back what it did
	// not send (below), and the connection is reset then anyway.
	d.count(int64(d.n))
	d.recv()
}

// linkedSendDone runs at the completion of a recv linked behind a send (sendThenRecv): unless
// the send reported a failure, it completed in full, silently.
func (d *udir) linkedSendDone() {
	if !d.linked {
		return
	}
	d.linked = false
	d.u.inflight-- // the send's, which posted nothing
	d.u.l.releaseBuf(uint16(d.buf))
	d.buf = -1
}

func sendError(res int32) error {
	if res < 0 {
		return os.NewSyscallError("send", syscall.Errno(-res))
	}
	return fmt.Errorf("send: %d bytes of the buffer sent before it failed", res)
}

func (d *udir) send() {
	l := d.u.l
	var b []byte
	if d.own != nil {
		b = d.own[:]
	} else {
		b = l.bufs.Buf(uint16(d.buf))
	}
	s := l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpSend, d.dst(), unix.MSG_NOSIGNAL
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&b[d.off]))), uint32(d.n-d.off)
	s.UserData = userData(d.u.slot, tagSendUp+d.i)
	d.u.inflight++
}

func (d *udir) sent(res int32) {
	u := d.u
	if res < 0 {
		u.c.legFailed(d.i == 0, true, os.NewSyscallError("send", syscall.Errno(-res)))
		return
	}
	if d.off += int(res); d.off < d.n {
		d.send()
		return
	}
	if d.own != nil {
		bufs.Put(d.own)
		d.own = nil
	} else {
		u.l.releaseBuf(uint16(d.buf))
		d.buf = -1
	}
	d.count(int64(d.n))
	if d.bulk {
		d.bulkMove()
		return
	}
	d.recv()
}

func (d *udir) count(n int64) {
	dir := &d.u.c.down
	if d.i == 0 {
		dir = &d.u.c.up
	}
	dir.count(n)
}

// bulkSlice bounds one bulkMove: then the loop serves its other connections (a poll for
// readability, which completes at once, brings the burst back).
const bulkSlice = 4 << 20

// bulkMove splices the source into the destination through a pipe, with non-blocking calls on
// the loop thread, until the source would block (back to recv: the direction holds nothing while
// it waits), the destination would block (a poll for writability), or bulkSlice bytes moved.
func (d *udir) bulkMove() {
	u := d.u
	if d.pipe == nil {
		p, err := pipes.get()
		if err != nil { // no descriptor for a pipe: copy through buffers instead
			d.bulk = false
			d.recv()
			return
		}
		d.pipe = p
	}
	moved := 0
	for moved < bulkSlice {
		if d.pn == 0 {
			n, err := sysSplice(int(d.src()), d.pipe.w, d.pipe.size)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				pipes.put(d.pipe, true)
				d.pipe, d.bulk = nil, false
				d.recv()
				return
			case err != nil:
				u.c.legFailed(d.i == 0, false, os.NewSyscallError("splice", err))
				return
			case n == 0:
				pipes.put(d.pipe, true)
				d.pipe = nil
				d.eof()
				return
			}
			d.pn = n
		}
		for d.pn > 0 {
			n, err := sysSplice(d.pipe.r, int(d.dst()), d.pn)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				d.poll(d.dst(), unix.POLLOUT)
				return
			case err != nil:
				u.c.legFailed(d.i == 0, true, os.NewSyscallError("splice", err))
				return
			}
			d.pn -= n
			moved += n
			d.count(int64(n))
		}
	}
	d.poll(d.src(), unix.POLLIN)
}

// polled resumes a direction after its poll: a bulk burst, or a read without a ring buffer.
func (d *udir) polled() {
	if d.nobuf {
		d.readOwn()
		return
	}
	d.bulkMove()
}

// readOwn reads what the readable source has into a pooled buffer and sends it; the direction
// then goes back to the buffer ring.
func (d *udir) readOwn() {
	buf := bufs.Get().(*[bufSize]byte)
	for {
		n, err := sysRead(int(d.src()), buf[:])
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			bufs.Put(buf)
			d.poll(d.src(), unix.POLLIN)
			return
		case err != nil:
			bufs.Put(buf)
			d.nobuf = false
			d.u.c.legFailed(d.i == 0, false, os.NewSyscallError("read", err))
			return
		case n == 0:
			bufs.Put(buf)
			d.nobuf = false
			d.eof()
			return
		}
		d.nobuf = false
		d.own, d.n, d.off = buf, n, 0
		d.bulk = n == bufSize
		d.send()
		return
	}
}

func (d *udir) poll(fd int32, events uint32) {
	s := d.u.l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpPollAdd, fd, events
	s.UserData = userData(d.u.slot, tagPollUp+d.i)
	d.u.inflight++
}

// eof forwards a FIN (the shared rules: conn.sawEOF).
func (d *udir) eof() {
	c := d.u.c
	if c.sawEOF(d.i == 0) {
		if err := sysShutdownWrite(int(d.dst())); err != nil {
			c.legFailed(d.i == 0, true, os.NewSyscallError("shutdown", err))
			return
		}
	}
	c.eofForwarded()
}

// --- buffers

func (l *loop) releaseBuf(id uint16) { l.bufs.Release(id) }
