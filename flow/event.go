package flow

import (
	"fmt"
	"net/netip"
	"sync/atomic"
	"time"
)

// Phase is the point in a flow's life an Event reports. A TCP connection reports Start (accepted,
// endpoint chosen), Held (waiting for an endpoint, when its port holds), Dial (the endpoint
// connected), FirstByte (the endpoint's first byte reached the proxy) and End; a UDP session
// Start (its first datagram, endpoint chosen) and End. A flow refused before it began (no
// endpoint, a denied source) reports End only. The kernel path reports Start and End from
// conntrack events.
type Phase uint8

// The phases, in the order a flow passes them.
const (
	PhaseStart Phase = iota
	PhaseHeld
	PhaseDial
	PhaseFirstByte
	PhaseEnd
	NumPhases
)

var phaseNames = [NumPhases]string{"start", "held", "dial", "first-byte", "end"}

func (p Phase) String() string {
	if p < NumPhases {
		return phaseNames[p]
	}
	return fmt.Sprintf("Phase(%d)", p)
}

// ParsePhase is String's inverse.
func ParsePhase(s string) (Phase, error) {
	for i, n := range phaseNames {
		if n == s {
			return Phase(i), nil
		}
	}
	return 0, fmt.Errorf("unknown phase %q: want one of %v", s, phaseNames)
}

// Verdict is what the proxy did with a flow: one vocabulary for TCP and UDP, the proxy socket
// and the kernel path. A live flow's events say Forwarded (or Held while it waits); its End says
// how it ended (VerdictOf).
type Verdict uint8

// The verdicts.
const (
	Forwarded   Verdict = iota // bytes moved both ways as asked; ended by either side's FIN, or live
	Refused                    // no endpoint: the client was reset (TCP) or the datagram dropped (UDP)
	Held                       // waiting for an endpoint (live), or given up at the hold timeout (End)
	DialFailedV                // TCP: every dial attempt failed
	Reset                      // a side reset (or vanished); the other leg was reset too
	Ejected                    // the endpoint left the Service (or was ejected) while the flow was live
	Drained                    // the endpoint's drain deadline passed
	Denied                     // the client is outside the Service's loadBalancerSourceRanges
	Timeout                    // idle for the idle timeout
	EvictedV                   // UDP: least recently used when the session table was full
	Unreachable                // UDP: the endpoint answered ICMP port unreachable
	Failed                     // UDP: another error on the endpoint's socket
	Closed                     // the proxy socket shut down (a Service removed, a port switched, the proxy stopping)
	Kernel                     // a flow of a kernel-path port, seen in conntrack
	NumVerdicts
)

var verdictNames = [NumVerdicts]string{"forwarded", "refused", "held", "dial-failed", "reset", "ejected",
	"drained", "source-denied", "timeout", "evicted", "unreachable", "failed", "closed", "kernel"}

func (v Verdict) String() string {
	if v < NumVerdicts {
		return verdictNames[v]
	}
	return fmt.Sprintf("Verdict(%d)", v)
}

// ParseVerdict is String's inverse.
func ParseVerdict(s string) (Verdict, error) {
	for i, n := range verdictNames {
		if n == s {
			return Verdict(i), nil
		}
	}
	return 0, fmt.Errorf("unknown verdict %q: want one of %v", s, verdictNames)
}

// endVerdicts maps each EndReason to its verdict.
var endVerdicts = [NumEndReasons]Verdict{
	Unknown:         Forwarded,
	ClientClosed:    Forwarded,
	EndpointClosed:  Forwarded,
	ClientReset:     Reset,
	EndpointReset:   Reset,
	IdleTimeout:     Timeout,
	DialFailed:      DialFailedV,
	NoEndpoints:     Refused,
	EndpointRemoved: Ejected,
	Shutdown:        Closed,
	Evicted:         EvictedV,
	EndpointRefused: Unreachable,
	EndpointError:   Failed,
	SourceDenied:    Denied,
	HoldTimeout:     Held,
	DrainTimeout:    Drained,
}

// VerdictOf is the verdict of an event of phase p for a flow that ended with r (Unknown while live).
func VerdictOf(p Phase, r EndReason) Verdict {
	switch {
	case p == PhaseHeld:
		return Held
	case p != PhaseEnd || r >= NumEndReasons:
		return Forwarded
	}
	return endVerdicts[r]
}

// Protocol of a flow.
type Protocol uint8

// The protocols.
const (
	TCP Protocol = iota
	UDP
)

func (p Protocol) String() string {
	if p == UDP {
		return "UDP"
	}
	return "TCP"
}

// Path is the data path that carried a flow.
type Path uint8

// The paths.
const (
	PathSocket Path = iota // the proxy socket (the visible path)
	PathKernel             // the kernel path's chains; the flow is seen in conntrack
)

func (p Path) String() string {
	if p == PathKernel {
		return "kernel"
	}
	return "socket"
}

// Port names the service port a flow belongs to. One is built per service port when its proxy
// socket (or kernel path) is set up and shared, read only, by every event of the port: the data
// path never builds one.
type Port struct {
	Namespace, Service, Port string // the Service's namespace and name, and the port's name ("" if unnamed)
	Protocol                 Protocol
	Path                     Path
	Node                     string // the node this proxy runs on
}

func (p *Port) String() string {
	if p == nil {
		return "?"
	}
	if p.Port == "" {
		return p.Namespace + "/" + p.Service
	}
	return p.Namespace + "/" + p.Service + ":" + p.Port
}

// Algorithm is the balancing algorithm that chose an endpoint.
type Algorithm uint8

// The algorithms (the portal-proxy.kubernetes.io/load-balancer values).
const (
	RoundRobin Algorithm = iota
	LeastConnections
	Random
	Hash
	NumAlgorithms
)

var algorithmNames = [NumAlgorithms]string{"round-robin", "least-connections", "random", "hash"}

func (a Algorithm) String() string {
	if a < NumAlgorithms {
		return algorithmNames[a]
	}
	return fmt.Sprintf("Algorithm(%d)", a)
}

// PickWhy says why an endpoint was chosen, beyond the algorithm: bits, any number set.
type PickWhy uint8

// The reasons.
const (
	// Affinity: the client's sticky endpoint (sessionAffinity: ClientIP) was reused.
	Affinity PickWhy = 1 << iota
	// Topology: topology hints (trafficDistribution) narrowed the candidates to this node's or
	// zone's endpoints.
	Topology
	// Local: a Local traffic policy (internalTrafficPolicy, or externalTrafficPolicy for
	// traffic from other hosts) limited the candidates to this node's endpoints.
	Local
	// SlowStart: the endpoint was in its slow-start window, its weight reduced.
	SlowStart
	// Retry: a pick after a failed dial or a refused datagram, skipping the failed endpoint.
	Retry
	// Terminating: only terminating endpoints were left (the proxy-terminating-endpoints rule).
	Terminating
)

var pickWhyNames = [...]string{"affinity", "topology", "local", "slow-start", "retry", "terminating"}

// Names lists the set reasons, for the stream.
func (w PickWhy) Names() []string {
	var out []string
	for i, n := range pickWhyNames {
		if w&(1<<i) != 0 {
			out = append(out, n)
		}
	}
	return out
}

// Pick is how a flow's endpoint was chosen.
type Pick struct {
	Algorithm Algorithm
	Why       PickWhy
	// Ref names the chosen endpoint's pod and node as the balancer knew them at the pick, so the
	// stream still names them after the endpoint or its Service is gone; nil if not known.
	Ref *EndpointRef
}

// EndpointRef names the pod behind an endpoint (namespace/name) and its node. One is built per
// endpoint when the proxier hands the balancer its endpoints, and shared, read only.
type EndpointRef struct {
	Pod, Node string
}

// Explainer is implemented by a picker that says how it chose (the balancer): the proxies ask
// it, when they record flows, so the stream shows why each endpoint was picked. A picker without
// it is reported as round robin with no reason.
type Explainer interface {
	NextWhy(client netip.Addr, reset bool) (netip.AddrPort, Pick, error)
}

// Event is one phase of one flow. The data path fills one on its own stack and hands a pointer to
// its Recorder, which copies what it keeps: an Event holds no pointer the data path allocated per
// flow (Port is the port's, Err is nil on a clean end).
type Event struct {
	Phase Phase
	// ID names the flow: unique in the process, the same in each of the flow's events.
	ID uint64
	// Time is when the phase happened.
	Time time.Time
	// Port is the service port's; the per-port Recorder sets it.
	Port *Port
	// Local is the address the client reached: the service address and port when the portal
	// keeps it (the original destination), else the proxy socket's.
	Local netip.AddrPort
	// Source is the proxy's own address on the endpoint leg (TCP: the dialed socket's local
	// address, Dial and later; UDP: the session socket's, Start and later). A capture needs it to
	// show the proxy-to-pod leg.
	Source netip.AddrPort
	// Pick is how Info.Endpoint was chosen (Start, Dial and later).
	Pick Pick
	// ConnectLatency is the successful dial's time to connect (TCP: Dial and later).
	ConnectLatency time.Duration
	// FirstByte is the time from the connect to the endpoint's first byte (TCP: FirstByte and
	// later; 0 if the endpoint sent nothing).
	FirstByte time.Duration
	// Info is the flow as at the phase: counters, the end reason and error at End.
	Info
}

// Verdict is the event's verdict. A UDP session has no close: its idle timeout is its normal
// end, so it is Forwarded (a TCP connection idle for its timeout is cut: Timeout).
func (e *Event) Verdict() Verdict {
	if e.Port != nil {
		switch {
		case e.Port.Path == PathKernel:
			return Kernel
		case e.Port.Protocol == UDP && e.Phase == PhaseEnd && e.End == IdleTimeout:
			return Forwarded
		}
	}
	return VerdictOf(e.Phase, e.End)
}

// Recorder takes the events of one service port's flows. The data path calls Record at each
// phase, on its own goroutine or ring thread: it must not block, and it should not allocate.
// e is valid only during the call.
type Recorder interface {
	Record(e *Event)
}

// Observed is implemented by a Recorder that knows whether anyone watches now. The data path
// reads what costs a system call per flow and matters only to a live observer or a capture (its
// own address on the endpoint leg, Event.Source) only while Observed says true: events recorded
// unwatched, for later, go without.
type Observed interface {
	Observed() bool
}

// Direction of bytes in a flow.
type Direction uint8

// The directions.
const (
	ToEndpoint Direction = iota // client to pod
	ToClient                    // pod to client
)

// Capturer is implemented by a Recorder that may capture payload. The data path asks Capture
// once per flow, when its endpoint is connected (TCP: Dial; UDP: Start), with that event; nil
// (the common case, one atomic load) means not captured. A captured flow hands every byte it
// moves to the Tap before sending it on.
type Capturer interface {
	Capture(e *Event) Tap
}

// Tap receives a captured flow's payload. Payload copies what it keeps (b is reused) and must
// not block; Close is called once, after the flow's End event.
type Tap interface {
	Payload(dir Direction, t time.Time, b []byte)
	Close()
}

// lastID is the last flow ID handed out: IDs are unique in the process across every proxy socket
// and protocol, so a stream merging ports never sees two flows under one ID.
var lastID atomic.Uint64

// NextID returns a new flow ID (never 0), for Event.ID: one atomic add.
func NextID() uint64 { return lastID.Add(1) }
