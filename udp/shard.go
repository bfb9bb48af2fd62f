package udp

import (
	"net/netip"
	"sync"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// shard is one loop of a Proxy: a listening socket of the port's SO_REUSEPORT group, the sessions
// of the clients the kernel steers to it (a client's address and port always hash to the same
// socket of the group), their backend sockets and the loop's I/O that watches them all (loopIO). A shard
// shares nothing with its siblings but the picker and the counters, so no lock is shared between
// loops.
//
// Concurrency: serve's goroutine does all socket I/O. The session table is guarded by mu, which
// the loop takes once per batch of ready sockets (not per datagram); the expiry timer and the
// Proxy's control methods take it too.
type shard struct {
	name   service.ServicePortName
	picker Picker
	cfg    Config
	log    logrus.FieldLogger
	stats  *counters
	// drainedOne is called once, when this shard is released (or closed) with no session left.
	drainedOne func()

	mu       sync.Mutex
	closed   bool
	released bool // Release: no more client datagrams are read
	drainOne sync.Once
	lfd      int    // listening socket, -1 while refusing
	io       loopIO // nil once closed (closeIO)
	sessions map[netip.AddrPort]*session
	byFD     map[int32]*session
	lru      lru
	ended    []flow.Info    // waiting for OnEnd, reported outside mu
	ev       flow.Event     // filled for each Config.Flows event (flows.go)
	laddr    netip.AddrPort // lfd's address, read once for the flow events (flows.go)
	lastWarn time.Time
}

// newShard serves the listening socket fd (owned by the shard from now on, also on error).
func newShard(p *Proxy, fd int, maxSessions int) (*shard, error) {
	io, err := newEpollIO(2 * maxBatch)
	if err == nil {
		if err = io.add(fd); err != nil {
			io.close()
		}
	}
	if err != nil {
		closeFD(fd)
		return nil, err
	}
	cfg := p.cfg
	cfg.MaxSessions = maxSessions
	return &shard{
		name: p.name, picker: p.picker, cfg: cfg, log: p.log, stats: &p.stats, drainedOne: p.shardDrained,
		lfd: fd, io: io,
		sessions: make(map[netip.AddrPort]*session),
		byFD:     make(map[int32]*session),
	}, nil
}

// close ends every session and closes the listening socket; a running loop is woken and sees
// closed. It returns the sessions to report.
func (s *shard) close() ([]flow.Info, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil
	}
	s.closed = true
	s.markDrained()
	for _, ss := range s.sessions {
		s.end(ss, flow.Shutdown)
	}
	var err error
	if s.lfd >= 0 {
		err = s.io.closeSocket(s.lfd)
		s.lfd, s.laddr = -1, netip.AddrPort{}
	}
	s.io.wake() // serve sees closed; the I/O is closed by closeIO after serve returned
	return s.takeEnded(), err
}

// closeIO releases the loop's I/O (its epoll set) once no loop runs on it (after serve
// returned, or when it never ran).
func (s *shard) closeIO() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.io == nil {
		return nil
	}
	err := s.io.close()
	s.io = nil
	return err
}

// refuse closes the listening socket, ending every session.
func (s *shard) refuse() ([]flow.Info, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.released || s.lfd < 0 {
		return nil, nil
	}
	for _, ss := range s.sessions {
		s.end(ss, flow.Shutdown)
	}
	err := s.io.closeSocket(s.lfd)
	s.lfd, s.laddr = -1, netip.AddrPort{}
	return s.takeEnded(), err
}

// listenAgain serves fd (owned by the shard from now on) after refuse.
func (s *shard) listenAgain(fd int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.lfd >= 0 || s.io == nil {
		closeFD(fd)
		return nil
	}
	if err := s.io.add(fd); err != nil {
		closeFD(fd)
		return err
	}
	s.lfd = fd
	return nil
}

// listening reports whether the shard has its socket (it has none while refusing).
func (s *shard) listening() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lfd >= 0
}

// release stops reading client datagrams and ends the sessions already answered (see
// Proxy.Release).
func (s *shard) release() []flow.Info {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.released {
		return nil
	}
	s.released = true
	if s.lfd >= 0 && s.io != nil {
		if err := s.io.remove(s.lfd); err != nil {
			s.log.WithError(err).Warn("Cannot stop reading client datagrams")
		}
	}
	s.endAnswered()
	s.checkDrained()
	return s.takeEnded()
}

// checkDrained marks the shard drained if it is released and no session is live. Called with mu
// held, after a session ended.
func (s *shard) checkDrained() {
	if !s.released {
		return
	}
	for _, ss := range s.sessions {
		if ss.fd >= 0 {
			return
		}
	}
	s.markDrained()
}

func (s *shard) markDrained() { s.drainOne.Do(s.drainedOne) }

// endEndpoint ends every session whose endpoint is ep, and returns how many and what to report.
func (s *shard) endEndpoint(ep netip.AddrPort, reason flow.EndReason) (int, []flow.Info) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ss := range s.sessions {
		if ss.endpoint == ep && ss.fd >= 0 {
			s.end(ss, reason)
			n++
		}
	}
	return n, s.takeEnded()
}

// live appends the shard's live sessions to out.
func (s *shard) live(out []flow.Info) []flow.Info {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ss := s.lru.back; ss != nil; ss = ss.lruPrev {
		if ss.fd >= 0 {
			out = append(out, ss.info(ss.lastActive, flow.Unknown))
		}
	}
	return out
}

func (s *shard) takeEnded() []flow.Info {
	e := s.ended
	s.ended = nil
	return e
}

func (s *shard) report(ended []flow.Info) { report(s.cfg.OnEnd, ended) }

// report hands ended sessions to onEnd (the access log), outside every lock.
func report(onEnd func(flow.Info), ended []flow.Info) {
	if onEnd == nil {
		return
	}
	for _, info := range ended {
		onEnd(info)
	}
}
