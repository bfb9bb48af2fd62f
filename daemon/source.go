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

// sourceSetup is the resolved --source-mode: transparent with its policy and plumbing, or proxy
// and why.
type sourceSetup struct {
	mode   service.SourceMode // SourceTransparent or SourceProxy
	why    string             // why not transparent ("" when it is)
	policy *transparent.Policy
	node   sourceNode
	// podCIDRsFixed: --node-pod-cidr was given, the Node object's spec.podCIDRs do not apply.
	podCIDRsFixed bool
	period        time.Duration
	log           logrus.FieldLogger

	mu       sync.Mutex
	lastErr  string // the last repair error logged, so a lasting failure is logged once
	failures int    // repairs that failed (metric)
}

// resolveSource probes the node for the transparent source mode (--source-mode auto or
// transparent): one Sync of the plumbing, which installs it or says why it cannot. Transparent
// asked for and impossible is an error; auto falls back to proxy with one log line.
func resolveSource(ctx context.Context, o *Options, node sourceNode, localAddrs func() []netip.Addr, log logrus.FieldLogger) (*sourceSetup, error) {
	s := &sourceSetup{mode: service.SourceProxy, period: o.syncPeriod, log: log, podCIDRsFixed: len(o.nodePodCIDRs) > 0}
	if o.sourceMode == string(service.SourceProxy) {
		s.why = "the node runs with --source-mode=proxy"
		return s, nil
	}
	if node == nil {
		s.why = "no transparent plumbing on this node"
		return s, nil
	}
	sup, err := node.Sync(ctx)
	if err != nil {
		if o.sourceMode == string(service.SourceTransparent) {
			return nil, fmt.Errorf("--source-mode=transparent: %w", err)
		}
		s.why = "the node cannot: " + err.Error()
		log.WithError(err).Warn("Transparent source mode unavailable: endpoints see this node's address (--source-mode=auto)")
		return s, nil
	}
	s.mode, s.node, s.policy = service.SourceTransparent, node, transparent.NewPolicy()
	s.policy.SetPodCIDRs(o.nodePodCIDRs)
	s.apply(sup, localAddrs())
	log.WithFields(logrus.Fields{"podCIDRs": fmt.Sprint(o.nodePodCIDRs), "bridge": sup.Bridge, "why not bridged pairs": sup.Reason}).
		Info("Transparent source mode: endpoints see the client's address where the replies pass this node")
	return s, nil
}

// apply hands the policy what the last Sync found and the node's addresses.
func (s *sourceSetup) apply(sup transparent.Support, local []netip.Addr) {
	s.policy.SetBridge(sup.Bridge)
	s.policy.SetLocalAddrs(local)
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

// run repairs the plumbing every sync period until ctx is done, and keeps the policy's view of
// the node (bridges, addresses) current. While the plumbing cannot be repaired the policy says
// no: a transparent dial whose replies do not come back would hang.
func (s *sourceSetup) run(ctx context.Context, localAddrs func() []netip.Addr) {
	t := time.NewTicker(s.period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		sup, err := s.node.Sync(ctx)
		s.mu.Lock()
		if err != nil {
			s.failures++
			if msg := err.Error(); msg != s.lastErr && ctx.Err() == nil {
				s.log.WithError(err).Error("Cannot repair the transparent source mode's plumbing: new connections come from this node's address until it is back")
				s.lastErr = msg
			}
			s.policy.SetEnabled(false)
		} else {
			if s.lastErr != "" {
				s.log.Info("Transparent source mode's plumbing repaired")
				s.lastErr = ""
			}
			s.apply(sup, localAddrs())
			s.policy.SetEnabled(true)
		}
		s.mu.Unlock()
	}
}

// collector exports the source mode: 1 for the mode in use, with why not transparent.
func (s *sourceSetup) collector() prometheus.Collector {
	mode := prometheus.NewDesc("kube_portal_proxy_source_mode", "The address endpoints see by default: 1 for the mode in use (transparent: the client's; proxy: this node's), with why not transparent.", []string{"mode", "reason"}, nil)
	fails := prometheus.NewDesc("kube_portal_proxy_transparent_repair_failures_total", "Periodic repairs of the transparent source mode's plumbing that failed (new connections dialed from the node's address meanwhile).", nil, nil)
	return collectorFunc{descs: []*prometheus.Desc{mode, fails}, collect: func(ch chan<- prometheus.Metric) {
		s.mu.Lock()
		why, failures := s.why, s.failures
		s.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(mode, prometheus.GaugeValue, 1, string(s.mode), why)
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
