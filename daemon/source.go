package daemon

// source.go: the transparent source mode (--source-mode): the node plumbing that brings the
// endpoints' replies to sockets bound to the clients' addresses (portal/transparent.Node), and
// the policy the data path asks per connection.

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/transparent"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// sourceNode installs and repairs the transparent plumbing (portal/transparent.Node).
type sourceNode interface {
	// Installed says, cheaply (netlink only), whether a predecessor left the plumbing in place.
	Installed(ctx context.Context) bool
	// BridgesChanged says, cheaply (one link dump), whether a bridge gained or lost its ports
	// since the last Sync.
	BridgesChanged(ctx context.Context) bool
	Sync(ctx context.Context) (transparent.Support, error)
}

// newSourceNode is the node's real plumbing: the iptables binaries --iptables-variant picks, nft
// and netlink.
func newSourceNode(o *Options, log logrus.FieldLogger) sourceNode {
	nl := &transparent.KernelNetlink{}
	return closingSourceNode{transparent.New(transparent.Config{Logger: log,
		Runner:  &transparent.ExecRunner{ExecRunner: iptables.ExecRunner{Variant: o.iptablesVariant}},
		Netlink: nl}), nl}
}

// closingSourceNode is a Node whose netlink handle closes with the run (Close).
type closingSourceNode struct {
	*transparent.Node
	nl *transparent.KernelNetlink
}

func (c closingSourceNode) Close() error { return c.nl.Close() }

// sourceSetup is the resolved --source-mode: what the node asks for (transparent, unless
// --source-mode=proxy) and, once the plumbing is in place, the policy that says yes.
type sourceSetup struct {
	mode     service.SourceMode // SourceTransparent (asked for) or SourceProxy
	explicit bool               // --source-mode=transparent: a node that cannot is an error
	why      string             // why the ports take proxy (mode proxy)
	policy   *transparent.Policy
	node     sourceNode
	// podCIDRsFixed: --node-pod-cidr was given, the Node object's spec.podCIDRs do not apply.
	podCIDRsFixed bool
	period        time.Duration
	log           logrus.FieldLogger

	mu       sync.Mutex
	on       bool   // the policy is enabled: the plumbing is in place
	notOn    string // why it is not ("" while on): the metric's reason
	lastErr  string // the last Sync error logged, so a lasting failure is logged once
	failures int    // periodic Syncs that failed (metric)
}

// resolveSource resolves --source-mode without delaying the start: the plumbing's first Sync
// (iptables-save and -restore of both families, nft, netlink: 15 ms on a quiet node, 600 ms at
// load 18) runs in run, after the sockets serve. Until it has worked the policy says no and every
// dial leaves from this node's address, unless a predecessor's plumbing is already in place
// (Installed: netlink only), as after a restart or a hand-over: then the policy says yes at once
// and run repairs whatever else is missing. Service ports resolve to transparent from the start
// (the node asks for it); a node that turns out to lack what the mode needs stays on the node's
// address, says why (log, kube_portal_proxy_source_mode) and keeps trying every sync period.
func resolveSource(ctx context.Context, o *Options, node sourceNode, localAddrs func() []netip.Addr, log logrus.FieldLogger) *sourceSetup {
	s := &sourceSetup{mode: service.SourceProxy, period: o.syncPeriod, log: log, podCIDRsFixed: len(o.nodePodCIDRs) > 0,
		explicit: o.sourceMode == string(service.SourceTransparent)}
	switch {
	case o.sourceMode == string(service.SourceProxy):
		s.why, s.notOn = "the node runs with --source-mode=proxy", "the node runs with --source-mode=proxy"
		return s
	case node == nil:
		s.why, s.notOn = "no transparent plumbing on this node", "no transparent plumbing on this node"
		return s
	}
	s.mode, s.node, s.policy = service.SourceTransparent, node, transparent.NewPolicy()
	s.policy.SetPodCIDRs(o.nodePodCIDRs)
	s.policy.SetLocalAddrs(localAddrs())
	if node.Installed(ctx) {
		s.on = true
	} else {
		s.notOn = "not installed yet"
	}
	s.policy.SetEnabled(s.on)
	return s
}

// run installs the plumbing at once, then repairs it every sync period until ctx is done, keeping
// the policy's view of the node (bridges, addresses) current. While the plumbing is not in place
// the policy says no: a transparent dial whose replies do not come back would hang.
func (s *sourceSetup) run(ctx context.Context, localAddrs func() []netip.Addr) {
	t := time.NewTicker(s.period)
	defer t.Stop()
	// A CNI creates its bridge when the first pod starts: until a Sync gives it the fdb entry,
	// a reply bridged between two of its pods would reach the client pod, which resets it. So
	// the bridges are looked at every bridgeCheck (one link dump) and a change Syncs at once.
	check := time.NewTicker(bridgeCheck)
	defer check.Stop()
	for first := true; ; first = false {
		for !first {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			case <-check.C:
				if !s.node.BridgesChanged(ctx) {
					continue
				}
			}
			break
		}
		sup, err := s.node.Sync(ctx)
		if ctx.Err() != nil {
			return
		}
		s.mu.Lock()
		wasOn := s.on
		if err != nil {
			s.failures++
			s.on, s.notOn = false, "the node cannot: "+err.Error()
			if msg := err.Error(); msg != s.lastErr {
				s.lastErr = msg
				l := s.log.WithError(err)
				switch {
				case wasOn:
					l.Error("Cannot repair the transparent source mode's plumbing: new connections come from this node's address until it is back")
				case s.explicit:
					l.Error("Transparent source mode unavailable (--source-mode=transparent): endpoints see this node's address; retrying every sync period")
				default:
					l.Warn("Transparent source mode unavailable: endpoints see this node's address (--source-mode=auto)")
				}
			}
		} else {
			s.policy.SetBridge(sup.Bridge || sup.NoBridges)
			s.policy.SetLocalAddrs(localAddrs())
			s.on, s.notOn = true, ""
			if first || s.lastErr != "" {
				s.log.WithFields(logrus.Fields{"podCIDRs": s.podCIDRsText(), "bridge": sup.Bridge, "bridges": !sup.NoBridges, "why not bridged pairs": sup.Reason}).
					Info("Transparent source mode: endpoints see the client's address where the replies pass this node")
			}
			s.lastErr = ""
		}
		s.policy.SetEnabled(s.on)
		s.mu.Unlock()
	}
}

// bridgeCheck is how often run looks for a bridge that gained its first port.
const bridgeCheck = time.Second

// podCIDRsText is the pod CIDRs for the log: the flag's, or where they come from.
func (s *sourceSetup) podCIDRsText() string {
	if s.podCIDRsFixed {
		return fmt.Sprint(s.policy.PodCIDRs())
	}
	return "the Node's spec.podCIDRs"
}

// setNode takes this node's pod CIDRs from its Node object, unless --node-pod-cidr fixed them.
func (s *sourceSetup) setNode(n *v1.Node) {
	if s == nil || s.policy == nil || s.podCIDRsFixed || n == nil {
		return
	}
	cidrs := n.Spec.PodCIDRs
	if len(cidrs) == 0 && n.Spec.PodCIDR != "" {
		cidrs = []string{n.Spec.PodCIDR}
	}
	var out []netip.Prefix
	for _, c := range cidrs {
		if p, err := netip.ParsePrefix(c); err == nil {
			out = append(out, p)
		}
	}
	s.policy.SetPodCIDRs(out)
}

// collector exports the source mode: 1 for the mode in use, with why not transparent.
func (s *sourceSetup) collector() prometheus.Collector {
	mode := prometheus.NewDesc("kube_portal_proxy_source_mode", "The address endpoints see by default: 1 for the mode in force (transparent: the client's, where the replies pass this node; proxy: this node's), with why not transparent.", []string{"mode", "reason"}, nil)
	fails := prometheus.NewDesc("kube_portal_proxy_transparent_repair_failures_total", "Syncs of the transparent source mode's plumbing that failed (new connections dialed from the node's address meanwhile).", nil, nil)
	return collectorFunc{descs: []*prometheus.Desc{mode, fails}, collect: func(ch chan<- prometheus.Metric) {
		s.mu.Lock()
		m, why, failures := service.SourceProxy, s.notOn, s.failures
		if s.on {
			m = service.SourceTransparent
		}
		s.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(mode, prometheus.GaugeValue, 1, string(m), why)
		ch <- prometheus.MustNewConstMetric(fails, prometheus.CounterValue, float64(failures))
	}}
}

// interfaceAddrs lists the addresses of this node's interfaces (the policy never dials from or
// to one of them transparently).
func interfaceAddrs() []netip.Addr {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var out []netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}
