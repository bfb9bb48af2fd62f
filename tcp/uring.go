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

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/iouring"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
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
//     with a hold configured waits on a goroutine (hold.go) and comes back to the loop, while a
//     multishot poll on the loop watches the held client socket (uconn.watchHeld);
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
	tagClose     // IORING_OP_CLOSE of a connection's socket (loop.closeFd)
	tagSockopt   // a dialed socket's setsockopt (uconn.queueLegOptions): posts only a failure, ignored
	tagHoldWatch // the multishot poll of a held client's socket (uconn.watchHeld)
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
	// spareP: the engine raises GOMAXPROCS by one while it runs (see startLoops).
	spareP    bool
	prevProcs int
	ringBufs  int // buffers per loop; 0 means uringBufs (tests make it small)
	// faults injects the failures the kernel gives rarely (a ring that cannot be set up, an
	// io_uring_enter that fails): this package's tests set it; nil in production.
	faults ringFaults
	// log gets the engine's own lines: a failed start, a loop that died (fallback.go).
	log logrus.FieldLogger

	startOnce sync.Once
	startErr  error
	mu        sync.Mutex
	closed    bool
	loops     []*loop
	wg        sync.WaitGroup

	// The fallback to epoll (fallback.go), guarded by mu.
	fallen     bool
	fellBackCh chan struct{}       // closed when fallen; made on first use
	armed      map[*Proxy]struct{} // the proxies with accepts armed on the loops
	failures   [numPhases]uint64
	loopErr    error // the first loop's death
}

func newIOUring(threads int, log logrus.FieldLogger) *uringEngine {
	if threads <= 0 {
		return &uringEngine{threads: runtime.GOMAXPROCS(0), spareP: true, log: log}
	}
	return &uringEngine{threads: threads, log: log}
}

func (e *uringEngine) Name() string { return EngineIOUring }

// blockingListener: a listener the rings accept on stays out of the runtime poller, until the
// engine has fallen back to epoll.
func (e *uringEngine) blockingListener() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return !e.fallen
}

// setUp sets up the loops on first use. If they cannot be set up, the engine falls back to
// epoll (fallback.go) and setUp keeps failing: each proxy then accepts on the epoll engine.
func (e *uringEngine) setUp() error {
	e.startOnce.Do(func() {
		e.startErr = e.startLoops()
		if e.startErr != nil && e.startErr != errEngineClosed {
			e.fallBack(phaseStart, fmt.Errorf("start the io_uring engine: %w", e.startErr))
		}
	})
	return e.startErr
}

func (e *uringEngine) startLoops() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return errEngineClosed
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
		l := &loop{nbufs: e.ringBufs, faults: e.faults}
		if l.nbufs == 0 {
			l.nbufs = uringBufs
		}
		e.loops = append(e.loops, l)
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			// The thread stays locked: it exits with the goroutine, and the ring with it.
			runtime.LockOSThread()
			if err := l.run(ready); err != nil {
				e.fallBack(phaseRun, fmt.Errorf("an io_uring loop stopped: %w", err))
			}
		}()
	}
	var err error
	for range e.threads {
		if lerr := <-ready; lerr != nil && err == nil {
			err = lerr
		}
	}
	if err != nil {
		for _, l := range e.loops {
			l.post(func() { l.stopping = true })
		}
	}
	return err
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
// SetRefusing replaces it, until the proxy is closed. The loops do the accepting; once the engine
// has fallen back to epoll, this goroutine does.
func (e *uringEngine) acceptLoop(p *Proxy) error {
	if e.setUp() == nil {
		fellBack := e.fellBack()
	accepting:
		for {
			p.lnMu.Lock()
			e.arm(p)
			changed := p.lnChanged.wait()
			p.lnMu.Unlock()
			select {
			case <-changed:
			case <-p.closed.wait():
				return nil
			case <-fellBack:
				break accepting
			}
		}
	}
	// The engine fell back (fallback.go): this goroutine accepts on the epoll engine now.
	p.lnMu.Lock()
	e.toEpoll(p)
	p.lnMu.Unlock()
	return p.acceptLoop()
}

// uringAccepting is what the engine keeps in a Proxy (Proxy.uring), guarded by p.lnMu.
type uringAccepting struct {
	// ln is the listener the loops accept on, with accepts, one per loop.
	ln      *sock
	accepts []*uaccept
	// armsItself: started by Start, so no acceptLoop waits on lnChanged; whatever changes ln
	// arms the new one itself (listenerChanged).
	armsItself bool
	// onEpoll: the engine fell back, and this proxy accepts on the epoll engine (fallback.go).
	onEpoll bool
}

// start is Proxy.Start on this engine: the loops accept for p, and no goroutine waits in Run.
func (e *uringEngine) start(p *Proxy) (bool, error) {
	if !p.addr.IsValid() {
		return true, fmt.Errorf("tcp proxy %s: Start before Listen", p.name)
	}
	if e.setUp() != nil {
		// The engine fell back to epoll (fallback.go: logged and counted there): Run accepts.
		return false, nil
	}
	p.startBackground()
	p.lnMu.Lock()
	defer p.lnMu.Unlock()
	p.uring.armsItself = true
	if !p.closed.fired() {
		e.arm(p)
	}
	return true, nil
}

// listenerChanged arms the new listener of a proxy the engine started (Start); a proxy that runs
// (Run) re-arms it in acceptLoop, woken by lnChanged. The caller holds p.lnMu.
func (e *uringEngine) listenerChanged(p *Proxy) {
	if p.uring.armsItself {
		e.arm(p)
	}
}

// arm arms an accept on every loop for p's listening socket unless that is done already or p is
// refusing. The caller holds p.lnMu: Close and SetRefusing cancel what is armed before closing
// ln, so an accept is never armed on a closed (and maybe reused) descriptor.
func (e *uringEngine) arm(p *Proxy) {
	ln := p.ln
	if ln == nil || p.uring.ln == ln {
		return
	}
	if !e.track(p) {
		// Fallen back: a proxy the engine started accepts on a goroutine now; a proxy that
		// runs switches its acceptLoop itself.
		if p.uring.armsItself {
			e.toEpoll(p)
		}
		return
	}
	var fd int
	_ = ln.raw.Control(func(f uintptr) { fd = int(f) })
	accs := make([]*uaccept, len(e.loops))
	for i, l := range e.loops {
		a := &uaccept{p: p, fd: int32(fd)}
		accs[i] = a
		if !l.post(func() { l.armAccept(a) }) {
			a.done.fire()
		}
	}
	p.uring.accepts, p.uring.ln = accs, ln
}

// stopAccepting cancels the accepts armed on ln and waits for the loops to confirm. The caller
// holds p.lnMu (the loops never take it).
func (e *uringEngine) stopAccepting(p *Proxy, ln *sock) {
	if p.uring.ln != ln {
		return
	}
	e.disarm(p, ln)
	e.acceptQueued(p, ln)
}

// disarm cancels the accepts armed on ln and waits for the loops to confirm. The caller holds
// p.lnMu.
func (e *uringEngine) disarm(p *Proxy, ln *sock) {
	e.untrack(p)
	accs := p.uring.accepts
	p.uring.accepts, p.uring.ln = nil, nil
	for i, a := range accs {
		l := e.loops[i]
		if !l.post(func() { l.cancelAccept(a) }) {
			a.finish()
		}
	}
	for _, a := range accs {
		<-a.done.wait()
	}
}

// acceptQueued serves, once the loops' accepts on ln are cancelled, the connections left in its
// queue. The kernel arms an io_uring accept as an exclusive waiter on the listener, and a new
// connection wakes one exclusive waiter only: when that is an accept being cancelled, the wake-up
// is spent, and the connection waits in the queue, though another process's ring is armed on the
// same socket after a hand-over, until the next connection wakes it: for ever, for a client that
// waits for an answer before it connects again (TestStopAcceptingStrandsNoConnection, 100
// hand-overs between two rings: each of 3 runs stranded one before, none of 5 after). With the
// cancels done nothing of this process waits on ln, so what is queued now holds every connection
// whose wake-up was spent here; later ones wake the other waiters. A connection served here is
// this proxy's, as one accepted just before the cancel.
func (e *uringEngine) acceptQueued(p *Proxy, ln *sock) {
	var fds []int
	var peers []netip.AddrPort
	_ = ln.raw.Control(func(lfd uintptr) {
		fds, peers = acceptWaiting(int(lfd), maxStranded)
	})
	if len(fds) == 0 {
		return
	}
	p.logger().WithField("connections", len(fds)).Debug("accepted the connections left in the queue when accepting stopped")
	for _, l := range e.loops {
		done := make(chan struct{})
		if l.post(func() {
			defer close(done)
			for i, fd := range fds {
				l.serve(p, fd, peers[i])
			}
		}) {
			<-done // served before Close counts the connections left
			return
		}
	}
	// No loop is left (the engine fell back to epoll): the epoll engine serves them.
	for i, fd := range fds {
		p.serveEpoll(fd, peers[i])
	}
}

// maxStranded bounds acceptQueued: a queue that refills as fast as it is read is being served by
// the other waiters.
const maxStranded = 1024

// acceptWaiting accepts, without waiting, up to max connections queued on the listening socket
// lfd: each accept comes after poll says one is queued. The listener may be a blocking one (the
// io_uring engine's, shared with a successor), so before the first accept boundAccept covers the
// other process taking a connection between the poll and the accept.
func acceptWaiting(lfd, max int) (fds []int, peers []netip.AddrPort) {
	pfd := []unix.PollFd{{Fd: int32(lfd), Events: unix.POLLIN}}
	bounded := false
	for len(fds) < max {
		if n, err := unix.Poll(pfd, 0); err != nil || n == 0 {
			break
		}
		if !bounded {
			restore, ok := boundAccept(lfd)
			if !ok {
				break
			}
			defer restore()
			bounded = true
		}
		fd, sa, err := unix.Accept4(lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err == unix.EINTR || err == unix.ECONNABORTED {
			continue
		}
		if err != nil {
			break // EAGAIN: the other process took it; out of descriptors: leave it to it
		}
		fds, peers = append(fds, fd), append(peers, sockopt.FromSockaddr(sa))
	}
	return fds, peers
}

// boundAccept makes an accept on lfd return within 10 ms when it is a blocking listener (a
// receive timeout bounds a blocking accept; no other user of the socket blocks in accept), and
// returns what puts the previous timeout back. false: the timeout could not be read or set.
func boundAccept(lfd int) (restore func(), ok bool) {
	fl, err := unix.FcntlInt(uintptr(lfd), unix.F_GETFL, 0)
	if err == nil && fl&unix.O_NONBLOCK != 0 {
		return func() {}, true
	}
	prev, err := unix.GetsockoptTimeval(lfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
	if err != nil {
		return nil, false
	}
	wait := unix.NsecToTimeval(int64(10 * time.Millisecond))
	if unix.SetsockoptTimeval(lfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &wait) != nil {
		return nil, false
	}
	return func() { _ = unix.SetsockoptTimeval(lfd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, prev) }, true
}

// ringFaults injects a loop's failures (uringEngine.faults).
type ringFaults interface {
	// setup, if it fails, fails the loop's set-up, as io_uring_setup or the registration of
	// its buffer ring would.
	setup() error
	// enter, if it fails, fails the loop's next io_uring_enter, as a broken ring would.
	enter() error
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
	done      signal // fired once cancelled and nothing is armed
}

func (a *uaccept) finish() { a.doneOnce.Do(func() { a.done.fire() }) }

// loop is one ring and what it serves. Everything but the inbox is the loop thread's own.
type loop struct {
	r     *iouring.Ring
	bufs  *iouring.BufRing
	nbufs int
	efd   int
	// faults: see uringEngine.faults.
	faults ringFaults
	efdv   [8]byte

	inMu     sync.Mutex
	inbox    []inboxItem
	spare    []inboxItem
	dead     bool // the loop has stopped: posts are refused
	sleeping atomic.Bool

	stopping   bool
	now        int64              // unix nanoseconds, read once per round after the wait (udir.count)
	yielded    int64              // l.now at the last yield (yieldEvery)
	sockCmds   bool               // the kernel runs setsockopt as a ring request (uconn.queueLegOptions)
	ringClosed bool               // teardown: descriptors are closed with close(2)
	reap       func(*iouring.CQE) // l.complete, bound once: no allocation per round
	conns      []*uconn
	free       []uint32
	bufsOut    int // ring buffers the kernel filled and the loop has not given back: tests read it
	accepts    []*uaccept
	freeAcc    []uint32
}

// inboxItem is what another goroutine asks of a loop: run f, or, without f, close u (the
// commonest request, once per connection: a closure for it was an allocation each time).
type inboxItem struct {
	f   func()
	u   *uconn
	rst bool
}

// post queues f to run on the loop; false if the loop has stopped.
func (l *loop) post(f func()) bool { return l.postItem(inboxItem{f: f}) }

func (l *loop) postItem(it inboxItem) bool {
	l.inMu.Lock()
	if l.dead {
		l.inMu.Unlock()
		return false
	}
	l.inbox = append(l.inbox, it)
	l.inMu.Unlock()
	if l.sleeping.Swap(false) {
		one := uint64(1)
		unix.Write(l.efd, (*[8]byte)(unsafe.Pointer(&one))[:])
	}
	return true
}

// run serves until the engine stops it (nil) or its ring breaks (the error). A loop that could
// not be set up sends its error on ready and returns nil.
func (l *loop) run(ready chan<- error) (broken error) {
	err := l.setup()
	ready <- err
	if err != nil {
		l.inMu.Lock()
		l.dead = true
		l.inMu.Unlock()
		return nil
	}
	defer func() { l.teardown(broken != nil) }()
	for !l.stopping {
		l.runInbox()
		if l.stopping {
			return nil
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
		if err := l.enter(wait); err != nil {
			// Only a broken ring fails here (EFAULT, EBADF); nothing on it can progress. The
			// engine logs it, counts it and falls back to epoll (fallback.go).
			return err
		}
		l.sleeping.Store(false)
		l.now = time.Now().UnixNano()
		l.r.Reap(l.reap)
		if l.now-l.yielded >= yieldEvery {
			l.yielded = l.now
			runtime.Gosched()
		}
	}
	return nil
}

// yieldEvery is how often a loop yields its P (runtime.Gosched) while it is busy. A loop's
// goroutine never parks: it waits in io_uring_enter, so the scheduler never runs it afresh, and
// sysmon takes it for one running for ever: every 10 ms it preempts it (a signal, the wait
// interrupted, the P handed away and back) and then polls every 20 µs again instead of backing
// off to 10 ms. That polling alone was 5% of the proxy's CPU in a pinned keep-alive profile
// (perf: runtime.sysmon's thread). A yield well inside sysmon's 10 ms shows it a goroutine
// that was scheduled anew, at the price of one hand-over of the P per yield.
const yieldEvery = int64(5 * time.Millisecond)

// enter is the ring's io_uring_enter, or the failure a test injects.
func (l *loop) enter(wait uint32) error {
	if l.faults != nil {
		if err := l.faults.enter(); err != nil {
			return err
		}
	}
	return l.r.Enter(wait)
}

func (l *loop) setup() error {
	if l.faults != nil {
		if err := l.faults.setup(); err != nil {
			return err
		}
	}
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
	l.sockCmds = r.SocketCommands()
	l.armWake()
	return nil
}

// teardown closes what is left. The engine is closed after the proxies, which end their
// connections first; a connection still open here is closed and ends as if its peers had gone, so
// that no Shutdown waits for it. After a broken ring (reset) its connections are reset: their
// bytes in flight are lost, and a peer must not take the end for a clean one.
func (l *loop) teardown(reset bool) {
	l.inMu.Lock()
	l.dead = true
	l.inMu.Unlock()
	l.runInbox() // cancel requests queued before dead: their waiters must hear back
	for _, a := range l.accepts {
		if a != nil {
			a.finish()
		}
	}
	_ = l.r.Enter(0) // the closes queued (closeFd)
	l.ringClosed = true
	l.r.Close() // cancels every request: descriptors are free to close
	for _, u := range l.conns {
		if u != nil && u.inflight >= 0 {
			if reset {
				for _, fd := range u.fd {
					if fd >= 0 {
						sysLingerZero(int(fd))
					}
				}
			}
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
	for i, it := range fs {
		if it.f != nil {
			it.f()
		} else {
			it.u.close(it.rst)
		}
		fs[i] = inboxItem{}
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
	case tagAcceptCancel, tagSockopt:
		return
	}
	u := l.conns[slot]
	if tag == tagHoldWatch {
		u.holdPolled(c)
		if u.closing && u.inflight == 0 {
			u.closeNow()
		}
		return
	}
	u.inflight--
	if c.Flags&iouring.CqeFBuffer != 0 {
		l.bufsOut++
	}
	if tag == tagSendUp || tag == tagSendDown {
		if d := &u.d[tag-tagSendUp]; d.linked {
			// The send of sendThenRecv: its recv is in the kernel already.
			d.linked = false
			if c.Res == int32(d.n) {
				l.releaseBuf(uint16(d.buf))
				d.buf = -1
				d.count(int64(d.n))
			} else {
				// A failed send's linked recv is cancelled; closeNow releases the buffer.
				if !u.closing {
					u.c.legFailed(d.i == 0, true, sendError(c.Res))
				}
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
	both := new(connAndUconn) // one allocation for both parts
	u := &both.u
	u.l, u.fd = l, [2]int32{int32(fd), -1}
	u.d[0] = udir{u: u, i: 0, buf: -1}
	u.d[1] = udir{u: u, i: 1, buf: -1}
	if n := len(l.free); n > 0 {
		u.slot, l.free = l.free[n-1], l.free[:n-1]
		l.conns[u.slot] = u
	} else {
		u.slot = uint32(len(l.conns))
		l.conns = append(l.conns, u)
	}
	u.c = &both.c
	p.initConn(u.c, peer, u)
	u.c.startFlow(fd)
	p.wg.Add(1)
	u.pick()
}

// connAndUconn is a connection on the io_uring engine: both parts live and die together.
type connAndUconn struct {
	c conn
	u uconn
}

// closeFd closes u's socket fd with the loop's next io_uring_enter (IORING_OP_CLOSE), two system
// calls per connection fewer, and reports true: its completion counts in u.inflight, and the
// close is done when it comes (an error, EBADF, would be a bug and is ignored like close(2)'s).
// At teardown, with the ring closed, it closes with close(2) and reports false.
func (l *loop) closeFd(u *uconn, fd int32) bool {
	if l.ringClosed {
		sysClose(int(fd))
		return false
	}
	s := l.r.Get()
	s.Opcode, s.Fd = iouring.OpClose, fd
	s.UserData = userData(u.slot, tagClose)
	u.inflight++
	return true
}

// --- buffers

func (l *loop) releaseBuf(id uint16) {
	l.bufs.Release(id)
	l.bufsOut--
}
