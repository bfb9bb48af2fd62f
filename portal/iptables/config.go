package iptables

import (
	"context"
	"net/netip"
	"time"

	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

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
	HostIPs map[portal.Family]netip.Addr
	// NodePortAddresses is --nodeport-addresses; empty means every local address.
	NodePortAddresses []netip.Prefix
	// PodCIDRs (--cluster-cidr) are the sources that are pods. Their traffic to the external portals
	// of a port whose external traffic has its own socket is cluster traffic: steered to the
	// cluster socket, as kube-proxy short-circuits it. Empty: pods count as external clients.
	PodCIDRs []netip.Prefix
	// ProtectProxyPorts adds the KUBE-PORTALS-GUARD filter chain: a new connection from outside the
	// node reaches a proxy port only when a portal rule translated it (conntrack state DNAT).
	ProtectProxyPorts bool
	// KernelPath keeps the kernel data path's top-level chains and jumps (kube-proxy's
	// KUBE-SERVICES, KUBE-POSTROUTING, ...; see portal/kernel) and programs the specs that ask for
	// it (Spec.Kernel). Off, such specs are skipped with an error.
	KernelPath bool
	// ConntrackTCPLiberal says nf_conntrack_tcp_be_liberal is set (--conntrack-tcp-be-liberal):
	// the kernel path then drops no INVALID packets in KUBE-FORWARD.
	ConntrackTCPLiberal bool
	// NoRandomFully leaves --random-fully off the kernel path's MASQUERADE (HasRandomFully false).
	NoRandomFully bool
	// VerifyPeriod is how often Sync reads the live chains back (one iptables-save per table) and
	// repairs them; 0 means DefaultVerifyPeriod.
	VerifyPeriod time.Duration
	// AfterNATRepair, if set, is called by the Sync that restored a nat table someone else had
	// flushed or changed, with the specs it applied: the connections that started meanwhile have
	// conntrack entries without NAT, which the caller deletes (conntrack.Netlink.ClearUntranslated)
	// so their next packet is steered. Errors are the caller's to log.
	AfterNATRepair func(ctx context.Context, specs []portal.Spec)
	// CounterInterval is how long KernelCounters reuses one read of the counters; 0 means
	// DefaultCounterInterval.
	CounterInterval time.Duration
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
	if c.CounterInterval <= 0 {
		c.CounterInterval = DefaultCounterInterval
	}
	if c.Clock == nil {
		c.Clock = clock.RealClock{}
	}
	if c.Logger == nil {
		c.Logger = portal.DiscardLogger()
	}
	return c
}
