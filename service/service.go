// Package service is the proxy's one vocabulary: service ports and their endpoints, converted once
// from the Kubernetes API (in proxier) into small comparable values that every other package shares.
package service

import (
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// ServicePortName names one port of one service: namespace/name:port (or namespace/name when the
// port has no name). It is the key of every per-service-port table in the proxy.
type ServicePortName struct {
	Namespace string
	Name      string
	Port      string
}

// String renders the name the way kube-proxy does, which is also the comment on every portal rule.
func (n ServicePortName) String() string {
	if n.Port == "" {
		return n.Namespace + "/" + n.Name
	}
	return n.Namespace + "/" + n.Name + ":" + n.Port
}

// ServiceName is the namespace/name part alone.
func (n ServicePortName) ServiceName() NamespacedName {
	return NamespacedName{Namespace: n.Namespace, Name: n.Name}
}

// NamespacedName names a Service (or the Service an EndpointSlice belongs to).
type NamespacedName struct {
	Namespace string
	Name      string
}

func (n NamespacedName) String() string { return n.Namespace + "/" + n.Name }

// Protocol is the L4 protocol of a service port.
type Protocol string

// The protocols a Service may declare. SCTP is recognised only to be rejected clearly.
const (
	TCP  Protocol = "TCP"
	UDP  Protocol = "UDP"
	SCTP Protocol = "SCTP"
)

// DefaultAffinityTimeout is the API default for sessionAffinityConfig.clientIP.timeoutSeconds.
const DefaultAffinityTimeout = 10800 * time.Second

// Affinity is the session affinity of a service port. The zero value is "None".
type Affinity struct {
	ClientIP bool
	// Timeout is how long a client stays with its endpoint after its last use; 0 means the default.
	Timeout time.Duration
}

// TTL is the effective affinity timeout.
func (a Affinity) TTL() time.Duration {
	if a.Timeout <= 0 {
		return DefaultAffinityTimeout
	}
	return a.Timeout
}

// TrafficDistribution is spec.trafficDistribution of a Service. The proxy does not act on it
// directly: like kube-proxy, it follows the topology hints the EndpointSlice controller derives
// from it. It is kept to explain a selection (a distribution asked for but no hints published).
type TrafficDistribution string

// The values the API accepts. PreferClose is the deprecated name of PreferSameZone.
const (
	PreferClose    TrafficDistribution = "PreferClose"
	PreferSameZone TrafficDistribution = "PreferSameZone"
	PreferSameNode TrafficDistribution = "PreferSameNode"
)

// Port is everything the proxy needs to know about one service port.
type Port struct {
	Name ServicePortName
	// UID is the Service object's UID (for events that `kubectl describe service` shows).
	UID      string
	Protocol Protocol
	// Port is the service port (spec.ports[].port).
	Port uint16
	// NodePort is 0 when the service has none.
	NodePort uint16
	// ClusterIPs holds at most one address per family, primary first.
	ClusterIPs      []netip.Addr
	ExternalIPs     []netip.Addr
	LoadBalancerIPs []netip.Addr
	Affinity        Affinity
	// ExternalLocal and InternalLocal record the traffic policies (externalTrafficPolicy: Local
	// on a service reachable from outside, internalTrafficPolicy: Local).
	ExternalLocal bool
	InternalLocal bool
	// HealthCheckNodePort is where a load balancer asks whether this node has local endpoints
	// (type LoadBalancer with externalTrafficPolicy: Local); 0 when there is none.
	HealthCheckNodePort uint16
	// LoadBalancerSourceRanges are the client ranges allowed to reach the load-balancer IPs,
	// masked, both families; empty allows every client.
	LoadBalancerSourceRanges []netip.Prefix
	// TrafficDistribution is spec.trafficDistribution, verbatim ("" when unset).
	TrafficDistribution TrafficDistribution
	// AccessLog asks for one log line per connection or UDP session of this port (an annotation).
	AccessLog bool
	// Balancing is how the balancer spreads new flows over the endpoints (annotations).
	Balancing Balancing
	// ProxyProtocol is the PROXY protocol header a TCP port sends its endpoints ("" for none;
	// an annotation, never set on a UDP port).
	ProxyProtocol ProxyProtocol
	// HoldTimeout, when positive on a TCP port, holds new connections that find no endpoint for
	// up to this long instead of refusing them (an annotation; UDP ports ignore it).
	HoldTimeout time.Duration
	// DataPath is the data path the Service asks for (an annotation); "" means the node's default.
	DataPath DataPath
	// DrainTimeout is how long the flows of an endpoint that left the rotation (terminating or
	// removed) may continue before what is left is closed (FIN, then reset); 0 means unset: the
	// node's --drain-removed-endpoints decides (an annotation).
	DrainTimeout time.Duration
	// SourceMode is the address the endpoints see (an annotation); "" means the node's
	// --source-mode.
	SourceMode SourceMode
}

// SourceMode is the address a proxied connection or UDP session reaches its endpoint from,
// spelled as the portal-proxy.kubernetes.io/source-mode annotation and --source-mode take it.
type SourceMode string

// The source modes.
const (
	// SourceProxy: the proxy dials from the node's own address (kube-proxy's userspace mode).
	SourceProxy SourceMode = "proxy"
	// SourceTransparent: the proxy dials from the client's address and port where the node's
	// routing brings the endpoint's replies back to it (portal/transparent), else from its own.
	SourceTransparent SourceMode = "transparent"
	// SourceAuto, for the node only: transparent where the node supports it, else proxy.
	SourceAuto SourceMode = "auto"
)

// DataPath is how a service port's traffic reaches its endpoints, spelled as the
// portal-proxy.kubernetes.io/data-path annotation and --default-data-path take it.
type DataPath string

// The data paths.
const (
	// DataPathProxy: portal rules steer the traffic to a proxy socket that connects to the
	// endpoint (visible: access log, per-endpoint flows, balancing policies).
	DataPathProxy DataPath = "proxy"
	// DataPathKernel: kube-proxy's iptables chains DNAT the traffic straight to the endpoint; no
	// proxy socket, nothing in user space (portal/kernel).
	DataPathKernel DataPath = "kernel"
)

// ProxyProtocol is a PROXY protocol version, spelled as the portal-proxy.kubernetes.io/proxy-protocol
// annotation takes it.
type ProxyProtocol string

// The PROXY protocol versions.
const (
	ProxyProtocolV1 ProxyProtocol = "v1"
	ProxyProtocolV2 ProxyProtocol = "v2"
)

// Holds reports whether the port holds new connections while it has no endpoint (TCP with a
// hold timeout), so that it must not be refused then.
func (p *Port) Holds() bool { return p.Protocol == TCP && p.HoldTimeout > 0 }

// Algorithm is how a service port's balancer picks the endpoint of a new connection or session.
type Algorithm string

// The algorithms, spelled as the portal-proxy.kubernetes.io/algorithm annotation takes them.
const (
	RoundRobin Algorithm = "round-robin"
	// LeastConnections picks the endpoint with the fewest live connections or sessions.
	LeastConnections Algorithm = "least-connections"
	// RandomTwoChoices draws two endpoints at random and keeps the one with fewer live flows.
	RandomTwoChoices Algorithm = "random-two-choices"
)

// Balancing is a service port's load-balancing policy. The zero value is plain round robin with
// no outlier detection.
type Balancing struct {
	// Algorithm "" means RoundRobin.
	Algorithm Algorithm
	// Outlier is passive outlier detection; off when its ConsecutiveFailures is 0.
	Outlier Outlier
	// SlowStart is the window over which a new or returning endpoint's share of new flows ramps
	// up linearly; 0 is off.
	SlowStart time.Duration
}

// Outlier is passive outlier detection: an endpoint that fails ConsecutiveFailures dials in a row
// (or resets that many connections at once) leaves the rotation for EjectionTime times the number
// of times it was ejected, capped, while at most MaxEjectionPercent of the endpoints are out.
type Outlier struct {
	ConsecutiveFailures int // 0: off
	EjectionTime        time.Duration
	MaxEjectionPercent  int
}

// Defaults of the outlier settings left unset when ConsecutiveFailures is set.
const (
	DefaultEjectionTime       = 30 * time.Second
	DefaultMaxEjectionPercent = 50
)

// On reports whether outlier detection is on.
func (o Outlier) On() bool { return o.ConsecutiveFailures > 0 }

// ExternallyAccessible reports whether the port takes traffic other than at its cluster IPs
// (a node port, external IPs or load-balancer IPs).
func (p *Port) ExternallyAccessible() bool {
	return p.NodePort != 0 || len(p.ExternalIPs) > 0 || len(p.LoadBalancerIPs) > 0
}

// Equal reports whether two ports are the same in every field.
func (p *Port) Equal(o *Port) bool {
	return p.SocketEqual(o) && p.Name == o.Name && p.Affinity == o.Affinity &&
		p.ExternalLocal == o.ExternalLocal && p.InternalLocal == o.InternalLocal &&
		p.HealthCheckNodePort == o.HealthCheckNodePort && p.TrafficDistribution == o.TrafficDistribution &&
		p.Balancing == o.Balancing && p.DrainTimeout == o.DrainTimeout && p.DataPath == o.DataPath &&
		slices.Equal(p.LoadBalancerSourceRanges, o.LoadBalancerSourceRanges)
}

// SocketEqual reports whether a proxy socket opened for p can serve o unchanged: protocol, the
// portal addresses, the access log (a socket hook), the PROXY protocol, the hold timeout and the
// source mode (socket settings) match. Affinity, traffic policies and
// distribution (they change which endpoints are picked), the health check node port (served
// elsewhere) and the source ranges (a filter in front of the socket) can change under a live
// socket.
func (p *Port) SocketEqual(o *Port) bool {
	return p.Protocol == o.Protocol && p.Port == o.Port && p.NodePort == o.NodePort && p.AccessLog == o.AccessLog &&
		p.ProxyProtocol == o.ProxyProtocol && p.HoldTimeout == o.HoldTimeout && p.SourceMode == o.SourceMode &&
		slices.Equal(p.ClusterIPs, o.ClusterIPs) && slices.Equal(p.ExternalIPs, o.ExternalIPs) &&
		slices.Equal(p.LoadBalancerIPs, o.LoadBalancerIPs)
}

func (p *Port) String() string {
	return fmt.Sprintf("%s %s/%d", p.Name, p.Protocol, p.Port)
}

// Endpoint is one backend address of a service port, with the conditions the proxy uses.
type Endpoint struct {
	Addr        netip.AddrPort
	Ready       bool
	Serving     bool
	Terminating bool
	// NodeName is where the endpoint runs, if known (for traffic policies and the debug view).
	NodeName string
	// Zone is the endpoint's zone, if known (the debug view; selection uses ZoneHints).
	Zone string
	// ZoneHints and NodeHints are the topology hints the EndpointSlice controller published
	// (hints.forZones, hints.forNodes): sorted, without duplicates, nil when there are none.
	ZoneHints []string
	NodeHints []string
	// TargetRef names the object behind the endpoint (usually its Pod), if known.
	TargetRef NamespacedName
}

// Equal reports whether two endpoints are the same in every field. (Endpoint holds slices, so
// it is not comparable with ==.)
func (e *Endpoint) Equal(o *Endpoint) bool {
	return e.Addr == o.Addr && e.Ready == o.Ready && e.Serving == o.Serving && e.Terminating == o.Terminating &&
		e.NodeName == o.NodeName && e.Zone == o.Zone && e.TargetRef == o.TargetRef &&
		slices.Equal(e.ZoneHints, o.ZoneHints) && slices.Equal(e.NodeHints, o.NodeHints)
}

// HasZoneHint reports whether the endpoint is hinted for zone.
func (e *Endpoint) HasZoneHint(zone string) bool {
	_, ok := slices.BinarySearch(e.ZoneHints, zone)
	return ok
}

// HasNodeHint reports whether the endpoint is hinted for node.
func (e *Endpoint) HasNodeHint(node string) bool {
	_, ok := slices.BinarySearch(e.NodeHints, node)
	return ok
}
