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

// Port is everything the proxy needs to know about one service port.
type Port struct {
	Name     ServicePortName
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
	// ExternalLocal and InternalLocal record the traffic policies (externalTrafficPolicy: Local,
	// internalTrafficPolicy: Local).
	ExternalLocal bool
	InternalLocal bool
	// AccessLog asks for one log line per connection or UDP session of this port (an annotation).
	AccessLog bool
}

// Equal reports whether two ports are the same in every field.
func (p *Port) Equal(o *Port) bool {
	return p.Name == o.Name && p.Protocol == o.Protocol && p.Port == o.Port && p.NodePort == o.NodePort &&
		slices.Equal(p.ClusterIPs, o.ClusterIPs) && slices.Equal(p.ExternalIPs, o.ExternalIPs) &&
		slices.Equal(p.LoadBalancerIPs, o.LoadBalancerIPs) && p.Affinity == o.Affinity &&
		p.ExternalLocal == o.ExternalLocal && p.InternalLocal == o.InternalLocal && p.AccessLog == o.AccessLog
}

// SocketEqual reports whether a proxy socket opened for p can serve o unchanged: protocol, the
// portal addresses and the access log (a socket hook) match. Affinity and policies can change
// under a live socket.
func (p *Port) SocketEqual(o *Port) bool {
	return p.Protocol == o.Protocol && p.Port == o.Port && p.NodePort == o.NodePort && p.AccessLog == o.AccessLog &&
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
}
