package tcp

import (
	"errors"
	"fmt"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/iouring"
)

// Engine accepts the connections of the proxies that share it and moves their bytes. The
// control of a connection (Allow, the pick and the dial ladder, hold, the PROXY header, the
// Observer and OnEnd accounting, drain, idle timeouts, Shutdown) is the same whichever engine
// serves it (conn.go, hold.go); an engine owns only the waiting: for a connection, for a dial to
// complete, for bytes to move.
//
//   - Epoll (splice.go, park.go): the Go runtime poller. A goroutine per dial and per active
//     direction, splice through pooled pipes, idle directions parked in an epoll set of their own.
//   - io_uring (uring.go): one ring per thread, single-shot accepts, connect with a linked timeout,
//     recv into a provided-buffer ring and send, splice for bulk bursts; no goroutine per
//     connection at all, and no readiness round trip.
type Engine interface {
	// Name is EngineEpoll or EngineIOUring.
	Name() string
	// Close stops the engine's threads. Call it once every proxy using it is shut down.
	Close() error
	// Status says which engine serves new sockets and counts the failures (an io_uring engine
	// falls back to epoll: fallback.go).
	Status() EngineStatus

	// blockingListener says Listen opens the listening socket blocking, out of the Go runtime
	// poller: an engine that accepts through its own rings must not have the runtime's epoll
	// woken for every new connection.
	blockingListener() bool
	// acceptLoop accepts p's connections until p is closed (Proxy.Run).
	acceptLoop(p *Proxy) error
	// start is Proxy.Start: it starts accepting p's connections on the engine's own threads and
	// reports true, or reports false when p needs Run (a goroutine of its own that accepts).
	start(p *Proxy) (started bool, err error)
	// listenerChanged follows SetRefusing's change of p.ln (p.lnMu held): an engine that
	// accepts for a started proxy arms the new listener.
	listenerChanged(p *Proxy)
	// stopAccepting returns once nothing accepts on ln any more, so that closing it closes the
	// socket (an accept request in flight holds a reference to it).
	stopAccepting(p *Proxy, ln *sock)
}

// Engine names, the values of --io-engine.
const (
	EngineAuto    = "auto"
	EngineIOUring = "io_uring"
	EngineEpoll   = "epoll"
)

// EngineNames are the values of --io-engine.
var EngineNames = []string{EngineAuto, EngineIOUring, EngineEpoll}

// Epoll is the engine on the Go runtime poller; a proxy whose Config.Engine is nil uses it.
var Epoll Engine = epollEngine{}

type epollEngine struct{}

func (epollEngine) Name() string                { return EngineEpoll }
func (epollEngine) Close() error                { return nil }
func (epollEngine) Status() EngineStatus        { return EngineStatus{Serving: EngineEpoll} }
func (epollEngine) blockingListener() bool      { return false }
func (epollEngine) acceptLoop(p *Proxy) error   { return p.acceptLoop() }
func (epollEngine) stopAccepting(*Proxy, *sock) {}
func (epollEngine) start(*Proxy) (bool, error)  { return false, nil }
func (epollEngine) listenerChanged(*Proxy)      {}

// ProbeIOUring tells whether the io_uring engine can run in this process: see iouring.Probe.
func ProbeIOUring() error { return iouring.Probe() }

// ChooseEngine returns the engine for --io-engine=name. "auto" is io_uring when probe (nil means
// ProbeIOUring) says this kernel and sandbox allow it, else epoll, with the reason io_uring was
// not taken in fallback (for one log line). "io_uring" fails if the probe does: asked for by name,
// it is not silently replaced. The engine is not started: its threads start with the first proxy
// that runs on it. log gets the engine's own lines (its fallback to epoll, when its rings fail
// after the probe passed: fallback.go); nil means logrus's standard logger.
func ChooseEngine(name string, probe func() error, log logrus.FieldLogger) (e Engine, fallback error, err error) {
	if probe == nil {
		probe = ProbeIOUring
	}
	switch name {
	case EngineEpoll:
		return Epoll, nil, nil
	case EngineIOUring:
		if err := probe(); err != nil {
			return nil, nil, fmt.Errorf("--io-engine=%s: io_uring is not available: %w", name, err)
		}
		return newIOUring(0, log), nil, nil
	case EngineAuto, "":
		if err := probe(); err != nil {
			return Epoll, err, nil
		}
		return newIOUring(0, log), nil, nil
	}
	return nil, nil, fmt.Errorf("--io-engine=%q: want one of %v", name, EngineNames)
}

// NewIOUring returns an io_uring engine with one ring per thread. threads 0 means one per P
// (GOMAXPROCS), and then the engine adds a P while it runs, so that its loops waiting in the
// kernel keep theirs (uring.go). It opens nothing until a proxy runs on it.
func NewIOUring(threads int) Engine { return newIOUring(threads, nil) }

// defaultEngine serves proxies whose Config.Engine is nil: Epoll, except in this package's tests
// run for the io_uring engine (engine_test.go).
var defaultEngine = Epoll

// engine returns the proxy's engine.
func (p *Proxy) engine() Engine {
	if p.cfg.Engine == nil {
		return defaultEngine
	}
	return p.cfg.Engine
}

var errEngineClosed = errors.New("io engine closed")
