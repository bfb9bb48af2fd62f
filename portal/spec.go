// Package portal is the vocabulary the portal modes share: a Spec per service port, the Portals
// interface the proxier drives, IP families, and the sockets that hold node ports so no other
// process can take them. The modes live beside it: portal/iptables (NAT rules, the default) and
// portal/bind (service IPs on a local link, no NAT); portal/conntrack clears the NAT's UDP
// conntrack entries. See README.md for the packet paths.
package portal

import (
	"cmp"
	"context"
	"net/netip"
	"slices"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Spec is what one service port needs from the portal layer.
type Spec struct {
	Name     service.ServicePortName
	Protocol service.Protocol
	// Port is the service port; NodePort is 0 when the service has none.
	Port     uint16
	NodePort uint16

	ClusterIPs      []netip.Addr
	ExternalIPs     []netip.Addr
	LoadBalancerIPs []netip.Addr

	// ProxyPort is the port of the local proxy socket the portals lead to.
	ProxyPort uint16
	// ExternalProxyPort, when not 0, is the proxy socket for external traffic: node ports,
	// external IPs and load-balancer IPs reached from outside the node. externalTrafficPolicy:
	// Local gives that traffic its own (node-local) endpoints, so it needs its own socket; traffic
	// from the node itself stays on ProxyPort, as kube-proxy short-circuits it to the cluster
	// endpoints.
	ExternalProxyPort uint16

	// RejectInternal and RejectExternal say that the service port has no usable endpoint for that
	// class of traffic (internal: cluster IPs, and anything from the node itself; external: the
	// rest). Its portals of that class are then not steered but refused by a filter-table REJECT
	// (TCP reset, ICMP port unreachable for UDP), so a client sees ECONNREFUSED at once instead of
	// a connection that is accepted and reset.
	RejectInternal bool
	RejectExternal bool

	// SourceRanges, when not empty, are the only client prefixes that reach the service through its
	// load-balancer IPs (loadBalancerSourceRanges); everything else to those IPs is dropped.
	SourceRanges []netip.Prefix

	// Kernel, when set, puts the port on the kernel data path: kube-proxy's iptables-mode chains
	// (portal/kernel) DNAT its traffic straight to the endpoints, and there is no proxy socket.
	// ProxyPort, ExternalProxyPort and the Reject fields are then unused.
	Kernel *KernelPath
}

// KernelPath is what the kernel data path needs of a service port beyond its addresses: the
// endpoints each traffic policy uses on this node, and the session affinity.
type KernelPath struct {
	// Cluster are the endpoints of the Cluster traffic policy (kube-proxy's KUBE-SVC chain): used
	// by cluster IPs unless internalTrafficPolicy is Local, and by external traffic unless
	// externalTrafficPolicy is Local (and always by external traffic from the node and its pods).
	Cluster []netip.AddrPort
	// Local are the endpoints on this node (KUBE-SVL), used by a Local traffic policy.
	Local []netip.AddrPort
	// InternalLocal and ExternalLocal are the traffic policies.
	InternalLocal, ExternalLocal bool
	// AnyEndpoints reports whether the port has a usable endpoint anywhere: a Local policy with no
	// local endpoint then drops (a load balancer may retry another node) instead of rejecting.
	AnyEndpoints bool
	// AffinitySeconds, when positive, is ClientIP session affinity with that timeout.
	AffinitySeconds int
}

// EndpointCounter is what the kernel counted for one endpoint of a kernel-path port: the packets
// and bytes through the DNAT rule of its KUBE-SEP chain. The nat table sees the first packet of
// each connection (UDP: of each flow) only, so Packets counts new connections and Bytes their first
// packets.
type EndpointCounter struct {
	Name     service.ServicePortName
	Protocol service.Protocol
	Endpoint netip.AddrPort
	Chain    string
	Packets  uint64
	Bytes    uint64
}

// Equal reports whether two kernel paths are the same (nil only equals nil).
func (k *KernelPath) Equal(o *KernelPath) bool {
	if k == nil || o == nil {
		return k == o
	}
	return k.InternalLocal == o.InternalLocal && k.ExternalLocal == o.ExternalLocal &&
		k.AnyEndpoints == o.AnyEndpoints && k.AffinitySeconds == o.AffinitySeconds &&
		slices.Equal(k.Cluster, o.Cluster) && slices.Equal(k.Local, o.Local)
}

// Clone returns a deep copy (nil for nil).
func (k *KernelPath) Clone() *KernelPath {
	if k == nil {
		return nil
	}
	c := *k
	c.Cluster, c.Local = slices.Clone(k.Cluster), slices.Clone(k.Local)
	return &c
}

// ProxyPorts lists the distinct proxy ports of the spec.
func (s *Spec) ProxyPorts() []uint16 {
	if ext := s.ExternalPort(); ext != s.ProxyPort {
		return []uint16{s.ProxyPort, ext}
	}
	return []uint16{s.ProxyPort}
}

// ExternalPort is the proxy port external traffic is steered to.
func (s *Spec) ExternalPort() uint16 {
	if s.ExternalProxyPort != 0 {
		return s.ExternalProxyPort
	}
	return s.ProxyPort
}

// CompareSpecs orders specs by service port name, then protocol: the order the proxier passes
// them in and the modes program them in.
func CompareSpecs(a, b Spec) int {
	return cmp.Or(cmp.Compare(a.Name.Namespace, b.Name.Namespace), cmp.Compare(a.Name.Name, b.Name.Name),
		cmp.Compare(a.Name.Port, b.Name.Port), cmp.Compare(a.Protocol, b.Protocol))
}

// Portals is what the proxier needs from a portal implementation: make the portals match the
// specs, and remove everything at --cleanup. iptables.Portals and bind.Portals satisfy it.
type Portals interface {
	Sync(ctx context.Context, specs []Spec) error
	Cleanup(ctx context.Context) error
}

// Family is an IP family: IPv4 rules go to iptables, IPv6 rules to ip6tables.
type Family uint8

// The families, numbered as people say them.
const (
	IPv4 Family = 4
	IPv6 Family = 6
)

// Families lists both families in the order they are programmed.
var Families = []Family{IPv4, IPv6}

func (f Family) String() string {
	if f == IPv6 {
		return "IPv6"
	}
	return "IPv4"
}

// FamilyOf is the family of an address (an IPv4-mapped IPv6 address counts as IPv4).
func FamilyOf(a netip.Addr) Family {
	if a.Unmap().Is4() {
		return IPv4
	}
	return IPv6
}

// DiscardLogger is the logger of a mode whose configuration names none.
func DiscardLogger() logrus.FieldLogger {
	l := logrus.New()
	l.Out = discard{}
	return l
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
