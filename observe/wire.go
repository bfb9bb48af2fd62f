// Package observe lets a user watch service traffic live: every flow event the proxy sockets
// (and, from conntrack, the kernel path) report goes into a fixed-size ring (Hub), observers
// follow it through /debug/flows with filters, and `kube-portal-proxy observe` prints it or writes
// a capture. This file is the wire format both sides speak: one JSON object per line (NDJSON), or
// per server-sent event.
package observe

import (
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Item is one line of the stream: exactly one of its fields is set.
type Item struct {
	Flow    *Flow    `json:"flow,omitempty"`
	Lost    *Lost    `json:"lost,omitempty"`
	Payload *Payload `json:"payload,omitempty"`
}

// Flow is one flow event (flow.Event) as the stream shows it.
type Flow struct {
	Time    time.Time `json:"time"`
	ID      uint64    `json:"id"`
	Phase   string    `json:"phase"`   // flow.Phase
	Verdict string    `json:"verdict"` // flow.Verdict
	// Node is the node whose proxy saw the flow.
	Node      string `json:"node,omitempty"`
	Namespace string `json:"namespace"`
	Service   string `json:"service"`
	Port      string `json:"port,omitempty"` // the port's name
	Protocol  string `json:"protocol"`       // TCP or UDP
	Path      string `json:"path"`           // socket or kernel

	Client    string `json:"client"`               // ip:port
	ClientPod string `json:"client_pod,omitempty"` // namespace/name, when the client is a known endpoint
	// ServiceAddress is the address the client reached (flow.Event.Local).
	ServiceAddress string `json:"service_address,omitempty"`
	// Source is the proxy's address on the endpoint leg (flow.Event.Source).
	Source       string `json:"source,omitempty"`
	Endpoint     string `json:"endpoint,omitempty"`
	EndpointPod  string `json:"endpoint_pod,omitempty"`  // namespace/name
	EndpointNode string `json:"endpoint_node,omitempty"` // the node the endpoint runs on

	Pick *Pick `json:"pick,omitempty"`

	DialAttempts    int    `json:"dial_attempts,omitempty"`
	ConnectMicros   int64  `json:"connect_us,omitempty"`    // the successful dial's connect latency
	FirstByteMicros int64  `json:"first_byte_us,omitempty"` // connect to the endpoint's first byte
	DurationMicros  int64  `json:"duration_us,omitempty"`   // the flow's age at the event
	BytesToEndpoint uint64 `json:"bytes_to_endpoint,omitempty"`
	BytesToClient   uint64 `json:"bytes_to_client,omitempty"`
	PacketsToEndpt  uint64 `json:"packets_to_endpoint,omitempty"`
	PacketsToClient uint64 `json:"packets_to_client,omitempty"`
	EndReason       string `json:"end_reason,omitempty"` // flow.EndReason, at End
	Error           string `json:"error,omitempty"`
}

// Pick says how the endpoint was chosen.
type Pick struct {
	Algorithm string   `json:"algorithm"`
	Why       []string `json:"why,omitempty"`
}

// Lost tells an observer it missed events: it read too slowly (the ring overtook it) or its
// rate cap dropped them. Count is how many since the last Lost item.
type Lost struct {
	Time   time.Time `json:"time"`
	Node   string    `json:"node,omitempty"`
	Count  uint64    `json:"count"`
	Reason string    `json:"reason"` // LostSlow, LostRate or LostCapture
}

// The reasons of Lost.
const (
	LostSlow = "slow-observer"
	LostRate = "rate-cap"
	// LostCapture counts payload pieces (not events) dropped because the observer's payload
	// queue was full.
	LostCapture = "capture-overflow"
)

// Payload is a piece of a captured flow's bytes, in the order they moved.
type Payload struct {
	ID        uint64    `json:"id"` // the flow's
	Node      string    `json:"node,omitempty"`
	Time      time.Time `json:"time"`
	Direction string    `json:"direction"` // DirToEndpoint or DirToClient
	Data      []byte    `json:"data"`      // base64 in JSON
	// Truncated marks the last piece kept: the flow reached its capture cap.
	Truncated bool `json:"truncated,omitempty"`
}

// The directions of Payload.
const (
	DirToEndpoint = "to-endpoint"
	DirToClient   = "to-client"
)

// Resolver names the pods behind addresses, for the stream. The proxier implements it from its
// EndpointSlices; both methods return "" when they do not know.
type Resolver interface {
	// Endpoint names the pod (namespace/name) and node of an endpoint of port.
	Endpoint(port *flow.Port, ep netip.AddrPort) (pod, node string)
	// Client names the pod (namespace/name) of a client address, when it is an endpoint of some
	// Service.
	Client(ip netip.Addr) (pod string)
}

// NewFlow converts an event for the stream. r may be nil.
func NewFlow(e *flow.Event, r Resolver) *Flow {
	f := &Flow{
		Time: e.Time, ID: e.ID, Phase: e.Phase.String(), Verdict: e.Verdict().String(),
		Client: addr(e.Client), ServiceAddress: addr(e.Local), Source: addr(e.Source), Endpoint: addr(e.Endpoint),
		DialAttempts: e.DialAttempts, ConnectMicros: e.ConnectLatency.Microseconds(),
		FirstByteMicros: e.FirstByte.Microseconds(), DurationMicros: e.Duration.Microseconds(),
		BytesToEndpoint: e.BytesToEndpoint, BytesToClient: e.BytesToClient,
		PacketsToEndpt: e.PacketsToEndpoint, PacketsToClient: e.PacketsToClient,
	}
	if p := e.Port; p != nil {
		f.Node, f.Namespace, f.Service, f.Port = p.Node, p.Namespace, p.Service, p.Port
		f.Protocol, f.Path = p.Protocol.String(), p.Path.String()
	}
	if e.Phase == flow.PhaseEnd {
		f.EndReason = e.End.String()
		if e.Err != nil {
			f.Error = e.Err.Error()
		}
	}
	if e.Endpoint.IsValid() && (e.Port == nil || e.Port.Path == flow.PathSocket) {
		f.Pick = &Pick{Algorithm: e.Pick.Algorithm.String(), Why: e.Pick.Why.Names()}
	}
	if ref := e.Pick.Ref; ref != nil { // named by the balancer at the pick: still right after the pod left
		f.EndpointPod, f.EndpointNode = ref.Pod, ref.Node
	}
	if r != nil {
		if e.Endpoint.IsValid() && e.Pick.Ref == nil {
			f.EndpointPod, f.EndpointNode = r.Endpoint(e.Port, e.Endpoint)
		}
		if e.Client.IsValid() {
			f.ClientPod = r.Client(e.Client.Addr())
		}
	}
	return f
}

func addr(a netip.AddrPort) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}
