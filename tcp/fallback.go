package tcp

import (
	"fmt"
	"net/netip"
	"os"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// The io_uring engine's fallback to epoll. The start-up probe (iouring.Probe) sets up a small ring;
// the engine's own rings are bigger and register a buffer ring, and may still fail (locked
// memory, a seccomp or LSM rule that counts). A ring may also break at run time: an
// io_uring_enter that fails (EFAULT, EBADF) stops its loop. Either way a listener the rings
// accepted on would keep its portal rule with nobody accepting, and its clients would wait in
// the accept queue for ever. So the engine falls back:
//
//   - every proxy accepts on the epoll engine from then on: a proxy that runs (Run) switches its
//     own acceptLoop; one the engine started (Start) gets an accept goroutine; a listener opened
//     blocking for the rings is put into the runtime poller (toEpoll); new listeners are opened
//     non-blocking;
//   - a loop that died resets its connections (teardown); the loops still alive keep serving
//     theirs, and accept nothing more;
//   - each failure is one log line and counts in Status (the daemon's metric); a loop's death is
//     Status.Err, which fails the daemon's /healthz: the node serves, but lost connections and
//     runs degraded until the process restarts. A failed start is not an error: it is the
//     probe's fallback, found later.

// Phases of an engine failure, the phase label of the metric.
const (
	phaseStart = iota // the rings could not be set up
	phaseRun          // a loop's ring broke
	numPhases
)

// EngineStatus is what an engine says about itself, for the metrics and /healthz.
type EngineStatus struct {
	// Serving is the engine new sockets are served on: the engine's Name, or EngineEpoll once
	// an io_uring engine has fallen back.
	Serving string
	// StartFailures counts failed starts of the io_uring engine (0 or 1), LoopFailures its loops
	// that died.
	StartFailures, LoopFailures uint64
	// Err is the first loop's death: the engine serves on epoll, but reset that loop's
	// connections, and stays degraded until the process restarts.
	Err error
}

// Status reports the engine's fallback and failures.
func (e *uringEngine) Status() EngineStatus {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := EngineStatus{Serving: EngineIOUring, StartFailures: e.failures[phaseStart], LoopFailures: e.failures[phaseRun], Err: e.loopErr}
	if e.fallen {
		st.Serving = EngineEpoll
	}
	return st
}

// fellBack is closed once the engine has fallen back to epoll.
func (e *uringEngine) fellBack() <-chan struct{} {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.fellBackChLocked()
}

func (e *uringEngine) fellBackChLocked() chan struct{} {
	if e.fellBackCh == nil {
		e.fellBackCh = make(chan struct{})
	}
	return e.fellBackCh
}

// track records that p's listener is about to be armed on the loops, so that a fallback finds
// it; false once the engine has fallen back (nothing is to be armed any more).
func (e *uringEngine) track(p *Proxy) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.fallen {
		return false
	}
	if e.armed == nil {
		e.armed = make(map[*Proxy]struct{})
	}
	e.armed[p] = struct{}{}
	return true
}

func (e *uringEngine) untrack(p *Proxy) {
	e.mu.Lock()
	delete(e.armed, p)
	e.mu.Unlock()
}

// fallBack records a failure of the given phase, logs it, and moves every proxy armed on the
// loops to the epoll engine (the first time).
func (e *uringEngine) fallBack(phase int, err error) {
	e.mu.Lock()
	e.failures[phase]++
	if phase == phaseRun && e.loopErr == nil {
		e.loopErr = err
	}
	first := !e.fallen
	var armed []*Proxy
	if first {
		e.fallen = true
		close(e.fellBackChLocked()) // proxies that run switch their own accept loops
		for p := range e.armed {
			armed = append(armed, p)
		}
	}
	e.mu.Unlock()
	log := e.logger().WithError(err).WithFields(logrus.Fields{"engine": EngineIOUring, "phase": phaseName(phase)})
	if phase == phaseRun {
		log.Error("io_uring loop died: its connections were reset; TCP is served on the epoll engine until the proxy restarts")
	} else {
		log.Warn("io_uring engine failed to start: TCP is served on the epoll engine")
	}
	for _, p := range armed {
		p.lnMu.Lock()
		e.toEpoll(p)
		p.lnMu.Unlock()
	}
}

// The phases of EngineStatus's failures, as the metric's phase label names them.
const (
	PhaseStart = "start"
	PhaseRun   = "run"
)

func phaseName(phase int) string {
	return [numPhases]string{phaseStart: PhaseStart, phaseRun: PhaseRun}[phase]
}

func (e *uringEngine) logger() logrus.FieldLogger {
	if e.log == nil {
		return logrus.StandardLogger()
	}
	return e.log
}

// toEpoll makes p accept on the epoll engine: the rings' accepts on its listener are cancelled
// (what waits in the queue is the epoll engine's to accept), the listener is put into the runtime
// poller, and a proxy the engine started gets an accept goroutine of its own. A proxy that runs
// calls it from its acceptLoop, then accepts there. The caller holds p.lnMu. Done once per proxy.
func (e *uringEngine) toEpoll(p *Proxy) {
	if p.uring.onEpoll {
		return
	}
	p.uring.onEpoll = true
	if p.uring.ln != nil {
		e.disarm(p, p.uring.ln)
	}
	if p.ln != nil {
		ln, err := p.ln.polled()
		if err != nil {
			// Nothing can accept on it: close it, so that the kernel refuses its clients at
			// once instead of queueing them (SetRefusing(false) may open it again).
			p.logger().WithError(err).Error("Cannot move the proxy socket to the epoll engine: refusing its clients")
			_ = p.ln.close()
			p.lnChanged.renew()
		}
		p.ln = ln
	}
	if !p.uring.armsItself {
		return
	}
	p.uring.armsItself = false
	if p.closed.fired() {
		return
	}
	p.wg.Add(1)
	go func() { // ends at Close, like Run's
		defer p.wg.Done()
		if err := p.acceptLoop(); err != nil {
			p.logger().WithError(err).Error("Proxy socket stopped")
		}
	}()
}

// polled returns a listener in the runtime poller with s's socket, and closes s. A blocking
// listener (the io_uring engine's) is not in the poller, and os.NewFile registers a descriptor
// only when it is created: the new one is a non-blocking duplicate (O_NONBLOCK belongs to the
// open file, so s's descriptor turns non-blocking too, and is closed).
func (s *sock) polled() (*sock, error) {
	var fd int
	var err error
	if cerr := s.raw.Control(func(f uintptr) { fd, err = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) }); cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, os.NewSyscallError("dup", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("set non-blocking", err)
	}
	if err := s.close(); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("close the blocking listener: %w", err)
	}
	return newSock(fd), nil
}

// serveEpoll serves a connection accepted outside the accept loop on the epoll engine.
func (p *Proxy) serveEpoll(fd int, peer netip.AddrPort) {
	if p.cfg.Allow != nil && !p.cfg.Allow(peer.Addr()) {
		p.deny(fd, peer)
		return
	}
	p.handle(fd, peer)
}
