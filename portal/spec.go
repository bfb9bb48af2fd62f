// Package portal steers service traffic into the proxy sockets: the legacy userspace KUBE-PORTALS
// and KUBE-NODEPORT iptables chains, written atomically with one iptables-restore per table, and
// the sockets that hold node ports so no other process can take them. See README.md for the
// packet path.
package portal

import (
	"context"
	"net/netip"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

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
}

// proxyPorts lists the distinct proxy ports of the spec.
func (s *Spec) proxyPorts() []uint16 {
	if ext := s.externalPort(); ext != s.ProxyPort {
		return []uint16{s.ProxyPort, ext}
	}
	return []uint16{s.ProxyPort}
}

// externalPort is the proxy port external traffic is steered to.
func (s *Spec) externalPort() uint16 {
	if s.ExternalProxyPort != 0 {
		return s.ExternalProxyPort
	}
	return s.ProxyPort
}

// Portals is what the proxier needs from a portal implementation: make the portals match the
// specs, and remove everything at --cleanup. The iptables portals (IPTables) and the bind mode
// satisfy it.
type Portals interface {
	Sync(ctx context.Context, specs []Spec) error
	Cleanup(ctx context.Context) error
}

var _ Portals = (*IPTables)(nil)

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

// DefaultVerifyPeriod is how often Sync reads the live chains back to repair changes made by others.
const DefaultVerifyPeriod = time.Minute

// Config is the node-level configuration of the iptables portals.
type Config struct {
	// BindAddress is --bind-address. Unspecified (0.0.0.0 or ::, or the zero Addr): CONTAINER rules
	// REDIRECT to the proxy port and HOST rules DNAT to the node's HostIP. Specific: both DNAT to it,
	// and only its family is programmed.
	BindAddress netip.Addr
	// HostIPs is the node IP per family, the target of HOST DNAT rules. With an unspecified bind
	// address a family without a host IP is skipped (one log line).
	HostIPs map[Family]netip.Addr
	// NodePortAddresses is --nodeport-addresses; empty means every local address.
	NodePortAddresses []netip.Prefix
	// ProtectProxyPorts adds the KUBE-PORTALS-GUARD filter chain: a new connection from outside the
	// node reaches a proxy port only when a portal rule translated it (conntrack state DNAT).
	ProtectProxyPorts bool
	// VerifyPeriod is how often Sync reads the live chains back (one iptables-save per table) and
	// repairs them; 0 means DefaultVerifyPeriod.
	VerifyPeriod time.Duration
	// Clock drives VerifyPeriod; nil means the real clock.
	Clock  clock.PassiveClock
	Logger logrus.FieldLogger
}

func (c Config) withDefaults() Config {
	if !c.BindAddress.IsValid() {
		c.BindAddress = netip.IPv4Unspecified()
	}
	c.BindAddress = c.BindAddress.Unmap()
	if c.VerifyPeriod <= 0 {
		c.VerifyPeriod = DefaultVerifyPeriod
	}
	if c.Clock == nil {
		c.Clock = clock.RealClock{}
	}
	if c.Logger == nil {
		l := logrus.New()
		l.Out = discard{}
		c.Logger = l
	}
	return c
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
