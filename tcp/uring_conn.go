package tcp

// The io_uring engine's connections and directions (uring.go has the engine, its loops and
// accepting).

import (
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/iouring"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// uconn is the io_uring engine's part of a connection; the loop's own.
type uconn struct {
	c        *conn
	l        *loop
	slot     uint32
	fd       [2]int32 // client, endpoint; -1 none
	inflight int      // requests in the kernel, plus a hold or back-off under way
	closing  bool     // terminate reached the loop: requests cancelled, nothing new starts
	// transparent: the attempt's socket is bound to the client's address (dialSource). A bool
	// beside closing, not the address (c has it: transparentSource): uconn keeps its size.
	transparent bool

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
	optv     [2]int32 // setsockopt values the kernel reads at submission (queueLegOptions)

	hdr []byte // the PROXY header while it is sent

	// the watch of a held client (watchHeld): holdCh is the hold's, nil once the watch is
	// stopped or has reported; holdArmed says the poll is in the kernel.
	holdCh                   chan<- flow.EndReason
	holdArmed, holdCancelled bool

	d [2]udir // client->endpoint, endpoint->client
}

var _ transport = (*uconn)(nil)

// closingLocked: nothing of a connection on a loop waits outside the loop, which releases its
// one share when the sockets are closed (closeNow).
func (u *uconn) closingLocked() (released int) { return 0 }

// terminate asks the loop to close the connection (conn.terminate, from any goroutine): the
// loop cancels what is in the kernel, closes the sockets, then releases its share.
func (u *uconn) terminate(rst bool) {
	u.l.postItem(inboxItem{u: u, rst: rst})
}

// finished: the loop gave back the buffers and pipes when it closed the sockets (closeNow).
func (u *uconn) finished() {}

// legs returns the sockets' descriptors (the loop's own: read them where the loop is quiet).
func (u *uconn) legs() (client, endpoint int) { return int(u.fd[0]), int(u.fd[1]) }

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
// The sockets are closed by ring requests (loop.closeFd), so it runs twice: once to queue the
// closes, and once they completed, to account (the Observer, OnEnd and Shutdown count on closed
// sockets: a reset must have gone out when OnEnd runs).
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
	queued := false
	for i, fd := range u.fd {
		if fd >= 0 {
			queued = l.closeFd(u, fd) || queued
			u.fd[i] = -1
		}
	}
	if queued {
		return // back here when the closes are done: OnEnd follows the closed sockets
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
	ep, err := c.next(u.reset)
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

// watchHeld watches a held client (conn.watchHeldClient), called by the hold's goroutine: the
// loop owns the client socket, so the loop watches it, with a multishot poll for input or a peer
// shutdown. Such a poll is edge-triggered: it completes once per arrival (data, FIN, RST), not
// again while the socket stays readable, so the bytes a client sends stay queued for the endpoint
// without the poll spinning. Each completion asks clientGone; stop cancels the poll (through the
// inbox, ahead of the hold's result, so it is cancelled before the dial starts).
func (u *uconn) watchHeld() (gone <-chan flow.EndReason, stop func()) {
	ch := make(chan flow.EndReason, 1)
	if !u.l.post(func() { u.armHoldWatch(ch) }) {
		return nil, func() {}
	}
	return ch, func() { u.l.post(u.stopHoldWatch) }
}

func (u *uconn) armHoldWatch(ch chan<- flow.EndReason) {
	if u.closing {
		return
	}
	u.holdCh, u.holdCancelled = ch, false
	u.armHoldPoll()
}

func (u *uconn) armHoldPoll() {
	s := u.l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpPollAdd, u.fd[0], unix.POLLIN|unix.POLLRDHUP
	s.Len = iouring.PollAddMulti
	s.UserData = userData(u.slot, tagHoldWatch)
	u.inflight++
	u.holdArmed = true
}

func (u *uconn) stopHoldWatch() {
	u.holdCh = nil
	if !u.holdArmed || u.holdCancelled || u.closing {
		return // nothing armed, or close cancels every request on the socket
	}
	u.holdCancelled = true
	s := u.l.r.Get()
	s.Opcode, s.Addr = iouring.OpAsyncCancel, userData(u.slot, tagHoldWatch)
	s.UserData = userData(u.slot, tagCancel)
	u.inflight++
}

// holdPolled handles a completion of the held client's poll: the client socket saw input, a FIN
// or a reset (or the poll ended: cancelled, or the kernel dropped the multishot).
func (u *uconn) holdPolled(c *iouring.CQE) {
	more := c.Flags&iouring.CqeFMore != 0
	if !more {
		u.holdArmed = false
		u.inflight--
	}
	if u.closing || u.holdCh == nil {
		return
	}
	if c.Res >= 0 {
		if reason, ok := clientGone(int(u.fd[0])); ok {
			u.holdCh <- reason // buffered, and sent once: holdCh is forgotten now
			u.holdCh = nil
			return
		}
	}
	if !more && c.Res != -int32(unix.ECANCELED) {
		u.armHoldPoll() // the kernel ended the multishot (an overflow, an error): watch on
	}
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
	if u.backoff == 0 {
		c.attempt(ep, u.attempt)
		u.ep, u.deadline = ep, time.Now().Add(c.p.cfg.DialTimeouts[u.attempt])
	}
	u.open(ep)
}

// open opens the attempt's socket and queues its connect.
//
// A transparent dial's IP_TRANSPARENT, SO_REUSEADDR and bind are plain system calls, not ring
// requests like the leg options: the bind must follow IP_TRANSPARENT, and its result decides,
// before the connect is queued, whether the dial falls back to the proxy's address on a new
// socket. As linked requests a failure would cancel the connect and come back as completions to
// untangle; and the ring's bind (IORING_OP_BIND) needs Linux 6.11.
func (u *uconn) open(ep netip.AddrPort) {
	c := u.c
	timeout := c.p.cfg.DialTimeouts[u.attempt]
	src := c.dialSource(ep)
	u.transparent = src.IsValid()
	fd, err := sysSocket(sockopt.Family(ep.Addr()))
	if err != nil {
		err = os.NewSyscallError("socket", err)
	} else if !u.l.sockCmds {
		if err = setLegOptions(fd, c.p.cfg.KeepAlive); err != nil {
			sysClose(fd)
		}
	}
	if err == nil && u.transparent {
		if err = bindSource(fd, src); err != nil {
			sysClose(fd)
			c.sourceFailed(src, ep, err)
			u.open(ep) // from the proxy's address: dialSource says so now
			return
		}
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
	if u.l.sockCmds {
		u.queueLegOptions(int32(fd), c.p.cfg.KeepAlive)
	}
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

// queueLegOptions queues setLegOptions' setsockopt calls as ring requests ahead of the connect:
// the kernel runs them in order when it takes the SQEs, in the io_uring_enter that submits the
// connect, instead of one system call each (up to four per connection). They post a completion
// only if they fail, which on a new TCP socket they do not: a failure would leave the option
// unset, as the accepted leg's options would be if the listener's had failed.
func (u *uconn) queueLegOptions(fd int32, keepAlive time.Duration) {
	u.optv = [2]int32{1, int32(max(int(keepAlive/time.Second), 1))}
	opt := func(level, name uint32, v *int32) {
		s := u.l.r.Get()
		s.Setsockopt(fd, level, name, v)
		s.Flags = iouring.SqeCQESkipSuccess
		s.UserData = tagSockopt
	}
	opt(unix.IPPROTO_TCP, unix.TCP_NODELAY, &u.optv[0])
	if keepAlive > 0 {
		opt(unix.SOL_SOCKET, unix.SO_KEEPALIVE, &u.optv[0])
		opt(unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, &u.optv[1])
		opt(unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, &u.optv[1])
	}
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
	u.reset = retryElsewhere(err)
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
		if res == -int32(unix.EADDRNOTAVAIL) && u.transparent {
			// The client's address and port already have a connection to ep (see dialSock).
			u.c.sourceFailed(u.c.transparentSource(), u.ep, err)
			u.open(u.ep)
			return
		}
		if outOfResources(err) && u.backOff(err) { // as the epoll engine's dialSock: same endpoint, later
			return
		}
		u.backoff = 0
		u.failed(c.p.cfg.DialTimeouts[u.attempt], err)
		return
	}
	if u.transparent {
		c.dialedTransparently()
	}
	if c.fl != nil {
		c.connectedNow()
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
	if c.fl != nil {
		if c.p.watched() {
			c.fl.ev.Source = sockopt.SockName(int(u.fd[1]))
		}
		c.dialRecorded()
	}
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
	// linked: a send of buf is in flight with the next recv linked behind it (sendThenRecv).
	linked bool
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
		if u.c.fl != nil {
			u.c.moved(d.i == 0, u.l.bufs.Buf(uint16(d.buf))[:d.n])
		}
		// A captured connection stays on the copy path: spliced bytes never reach its tap.
		d.bulk = int(res) == bufSize && !u.c.tapped()
		if d.bulk {
			d.send()
			return
		}
		d.sendThenRecv()
	}
}

// sendThenRecv sends the buffer and, linked behind it, the next recv, in one submission: the
// send waits until all of it is sent (MSG_WAITALL), and the kernel arms the recv once it has, so
// no round of the loop comes between them. The send's completion gives the buffer back to the
// ring. It once posted none (IOSQE_CQE_SKIP_SUCCESS) and the buffer went back when the next recv
// completed: an idle keep-alive connection held one buffer per direction, 64 connections held
// all 128 of a loop, and every further recv found the ring empty (ENOBUFS, then a poll and a read
// of its own: bench-device keepalive, 64 clients). A failed send posts its failure, and the
// linked recv is cancelled.
func (d *udir) sendThenRecv() {
	l := d.u.l
	b := l.bufs.Buf(uint16(d.buf))
	s := l.r.Get()
	s.Opcode, s.Fd, s.OpFlags = iouring.OpSend, d.dst(), unix.MSG_NOSIGNAL|unix.MSG_WAITALL
	s.Flags = iouring.SqeIOLink
	s.Addr, s.Len = uint64(uintptr(unsafe.Pointer(&b[0]))), uint32(d.n)
	s.UserData = userData(d.u.slot, tagSendUp+d.i)
	d.u.inflight++
	d.linked = true
	d.recv()
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
	c := d.u.c
	if c.p.realClock {
		// The time the loop read after its last wait: the idle timeout needs no finer stamp,
		// and reading the clock per send (twice per keep-alive request and direction) was 2% of
		// the proxy's CPU in a keep-alive profile (clock_gettime through the vDSO, twice per
		// time.Now).
		c.count(d.i == 0, n, d.u.l.now)
		return
	}
	c.count(d.i == 0, n, c.p.cfg.Clock.Now().UnixNano())
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
		if c := d.u.c; c.fl != nil {
			c.moved(d.i == 0, buf[:n])
		}
		d.bulk = n == bufSize && !d.u.c.tapped()
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
