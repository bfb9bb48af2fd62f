package tcp

// The live flow stream (Config.Flows): a connection's phases as flow.Events, and the payload of a
// captured one. With Flows nil a connection carries a nil pointer and pays one nil check per
// phase and per read, nothing more.

import (
	"net/netip"
	"sync"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// flowState is what a connection keeps for its flow events while Config.Flows is set. Its Event
// is filled in place and handed to the Recorder by pointer: an Event on the stack would escape
// through the interface call and cost an allocation per phase. The phases of one connection
// happen one after the other (each engine starts the directions after Dial, and End follows the
// last owner's release), so one Event serves them all. States are pooled: a connection with a
// Recorder allocates nothing more than one without.
type flowState struct {
	ev        flow.Event
	tap       flow.Tap
	dialStart int64 // the successful attempt's start, unix nanoseconds on the proxy clock
	connected int64 // when it connected
	held      bool  // the flow began with Held instead of Start
	firstByte bool  // FirstByte was recorded (the endpoint->client direction's)
	source    func(fd uintptr)
}

var flowStates = sync.Pool{New: func() any {
	fs := new(flowState)
	fs.source = fs.sourceFn // bound once: handing it to RawConn.Control allocates nothing
	return fs
}}

func newFlowState() *flowState {
	fs := flowStates.Get().(*flowState)
	fs.ev.ID = flow.NextID()
	return fs
}

func (fs *flowState) free() {
	*fs = flowState{source: fs.source}
	flowStates.Put(fs)
}

func (fs *flowState) sourceFn(fd uintptr) { fs.ev.Source = sockopt.SockName(int(fd)) }

// startFlow gives a new connection on the accepted socket fd its flow state, when the proxy
// records flows. Local is where the client was going: the service address when conntrack knows
// it (the portal redirected the connection), else the proxy socket's own address. It is read
// whether or not anyone watches (one getsockopt), so `observe --last` says it after the fact.
func (c *conn) startFlow(fd int) {
	p := c.p
	if p.cfg.Flows == nil {
		return
	}
	c.fl = newFlowState()
	c.fl.ev.Local = p.localAddr(fd, c.clientAddr)
}

// watched reports whether the flow stream has an observer now (or cannot say): the proxy's own
// address on the endpoint leg, a system call per flow that only a capture or a live observer
// needs, is read only then.
func (p *Proxy) watched() bool { return p.observed == nil || p.observed.Observed() }

func (p *Proxy) localAddr(fd int, client netip.AddrPort) netip.AddrPort {
	if a, err := originalDst(fd, client.Addr().Is4()); err == nil {
		return a
	}
	if p.addr.Addr().IsUnspecified() {
		return sockopt.SockName(fd)
	}
	return p.addr
}

// next asks the picker for an endpoint, with its reasons when the flow is recorded.
func (c *conn) next(reset bool) (netip.AddrPort, error) {
	p := c.p
	if c.fl == nil || p.explain == nil {
		return p.picker.Next(c.clientAddr.Addr(), reset)
	}
	ep, pick, err := p.explain.NextWhy(c.clientAddr.Addr(), reset)
	if err == nil {
		c.fl.ev.Pick = pick
	}
	return ep, err
}

// record hands the flow's event of phase ph to the Recorder, with the connection as it is now.
// The caller must not hold c.mu.
func (c *conn) record(ph flow.Phase) { c.recordInfo(ph, c.info()) }

func (c *conn) recordInfo(ph flow.Phase, info flow.Info) {
	fl := c.fl
	fl.ev.Phase, fl.ev.Info = ph, info
	fl.ev.Time = info.Start.Add(info.Duration) // info read the clock: now
	c.p.cfg.Flows.Record(&fl.ev)
}

// attempted follows each dial attempt's start (conn.attempt): the first one starts the flow,
// unless it was held (Held began it).
func (c *conn) attempted(i int) {
	fl := c.fl
	if i == 0 && !fl.held {
		c.record(flow.PhaseStart)
	}
	fl.dialStart = c.p.cfg.Clock.Now().UnixNano()
}

// connectedNow marks the dial's success.
func (c *conn) connectedNow() {
	fl := c.fl
	fl.connected = c.p.cfg.Clock.Now().UnixNano()
	fl.ev.ConnectLatency = time.Duration(fl.connected - fl.dialStart)
}

// dialRecorded reports Dial (fl.ev.Source set by the engine) and asks a capturing Recorder
// whether to capture the connection; before either direction starts.
func (c *conn) dialRecorded() {
	c.record(flow.PhaseDial)
	if cp := c.p.capturer; cp != nil {
		c.fl.tap = cp.Capture(&c.fl.ev)
	}
}

// tapped says the connection's bytes go through user space to its tap: no splice.
func (c *conn) tapped() bool { return c.fl != nil && c.fl.tap != nil }

// moved is told of b, bytes a direction (up: client->endpoint) read and is about to send on
// (empty when they went into a pipe): the endpoint's first byte, and the tap's payload.
func (c *conn) moved(up bool, b []byte) {
	fl := c.fl
	if !up && !fl.firstByte {
		fl.firstByte = true
		fl.ev.FirstByte = time.Duration(c.p.cfg.Clock.Now().UnixNano() - fl.connected)
		c.record(flow.PhaseFirstByte)
	}
	if fl.tap != nil && len(b) > 0 {
		dir := flow.ToClient
		if up {
			dir = flow.ToEndpoint
		}
		fl.tap.Payload(dir, time.Now(), b)
	}
}

// endFlow reports End, closes the tap and frees the state (conn.finish).
func (c *conn) endFlow(info flow.Info) {
	fl := c.fl
	c.recordInfo(flow.PhaseEnd, info)
	if fl.tap != nil {
		fl.tap.Close()
	}
	c.fl = nil
	fl.free()
}

// recordDenied reports the End of a client Allow refused: it never had a connection.
func (p *Proxy) recordDenied(fd int, info flow.Info) {
	fs := newFlowState()
	fs.ev.Phase, fs.ev.Time, fs.ev.Info = flow.PhaseEnd, info.Start, info
	fs.ev.Local = p.localAddr(fd, info.Client)
	p.cfg.Flows.Record(&fs.ev)
	fs.free()
}
