// Package conntrack deletes the UDP conntrack entries of the NAT portals (portal/iptables): once
// a service port or one of its addresses goes away, an entry that still maps a client to the old
// proxy port must go, or the client keeps talking to nothing. Netlink does it over ctnetlink with
// github.com/vishvananda/netlink; Fake records what it is asked, for the proxier's tests.
package conntrack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Flows names the UDP conntrack entries of one service port. When the port (or one of its
// addresses) goes away they must be deleted: conntrack keeps steering a client that keeps sending
// (DNS resolvers do) to the old proxy socket for as long as its entry lives. The legacy proxy
// cleared only the cluster IP; external, load-balancer and node-port entries lingered.
type Flows struct {
	// Addrs are the cluster, external and load-balancer IPs: entries whose original destination is
	// one of them at Port are deleted.
	Addrs []netip.Addr
	Port  uint16
	// NodePort, unless 0: entries whose original destination port is NodePort, on any address of
	// the families in Addrs (IPv4 when Addrs is empty).
	NodePort uint16
	// ProxyPorts, unless empty, narrows the deletion to the entries the portal rules redirected
	// to one of these proxy ports (the reply comes from it). A port that moved to the kernel path
	// must lose those, and only those: its DNAT rules are in force by then, and deleting an entry
	// they made for a datagram in flight loses the endpoint's answer (nothing is left to undo the
	// DNAT). An endpoint port equal to a proxy port makes such an entry go too, as before.
	ProxyPorts []uint16
	// Endpoints, unless empty, narrows the deletion to the entries DNATed to one of these
	// endpoints (the reply comes from it), as kube-proxy deletes a removed UDP endpoint's
	// entries: the flows of the endpoints that stay keep their answers in flight.
	Endpoints []netip.AddrPort
}

// FlowsOf returns the flows of a service port.
func FlowsOf(p *service.Port) Flows {
	var addrs []netip.Addr
	addrs = append(addrs, p.ClusterIPs...)
	addrs = append(addrs, p.ExternalIPs...)
	addrs = append(addrs, p.LoadBalancerIPs...)
	slices.SortFunc(addrs, netip.Addr.Compare)
	return Flows{Addrs: slices.Compact(addrs), Port: p.Port, NodePort: p.NodePort}
}

// FlowsOfSpec returns the destinations of a portal spec (as the rules in force steer them): its
// cluster, external and load-balancer IPs at its port, and its node port.
func FlowsOfSpec(s *portal.Spec) Flows {
	return Flows{Addrs: slices.Concat(s.ClusterIPs, s.ExternalIPs, s.LoadBalancerIPs), Port: s.Port, NodePort: s.NodePort}
}

// Interface deletes conntrack entries.
type Interface interface {
	// ClearUDP deletes every UDP entry to f's destinations.
	ClearUDP(ctx context.Context, f Flows) error
	// ClearUntranslated deletes the entries to fs's destinations that no portal rule translated
	// (untranslated.go), with one walk of the table per family for all of fs.
	ClearUntranslated(ctx context.Context, fs []Flows) error
}

var (
	_ Interface = (*Netlink)(nil)
	_ Interface = (*Fake)(nil)
)

// Netlink deletes entries over ctnetlink: per family one dump of the conntrack table, and one
// delete request for each entry that matches a filter of f (the conntrack(8) tool did the same
// per address, in a new process each time). The zero value is ready.
type Netlink struct {
	// Do, when set, runs each ClearUDP, e.g. on a thread switched into another network namespace
	// (tests pass netns.NS.Do). Nil runs it on the calling goroutine.
	Do func(func() error) error
}

// udpProto is IPPROTO_UDP as the conntrack filter takes it.
const udpProto = unix.IPPROTO_UDP

// ClearUDP implements Interface. It clears every family even when one fails, and returns all
// failures; entries already gone are not a failure.
func (n *Netlink) ClearUDP(ctx context.Context, f Flows) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	run := func(fn func() error) error { return fn() }
	if n.Do != nil {
		run = n.Do
	}
	byFamily, err := filters(f)
	if err != nil {
		return err
	}
	return run(func() error {
		h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
		if err != nil {
			return fmt.Errorf("conntrack: netlink handle: %w", err)
		}
		defer h.Close()
		var errs []error
		for _, fam := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
			fs := byFamily[fam]
			if len(fs) == 0 {
				continue
			}
			if _, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, fam, fs...); err != nil {
				errs = append(errs, fmt.Errorf("conntrack %s: delete UDP entries of %s: %w", familyName(fam), describe(f), err))
			}
		}
		return errors.Join(errs...)
	})
}

// filters builds the conntrack filters of f by family: one per address (original destination
// address and port) and one per family for the node port (original destination port).
func filters(f Flows) (map[netlink.InetFamily][]netlink.CustomConntrackFilter, error) {
	out := map[netlink.InetFamily][]netlink.CustomConntrackFilter{}
	for _, a := range f.Addrs {
		a = a.Unmap()
		fam := familyOf(a)
		cf, err := udpFilter(f.Port)
		if err == nil {
			err = cf.AddIP(netlink.ConntrackOrigDstIP, net.IP(a.AsSlice()))
		}
		if err != nil {
			return nil, fmt.Errorf("conntrack: filter for %s: %w", netip.AddrPortFrom(a, f.Port), err)
		}
		out[fam] = append(out[fam], narrow(cf, f))
	}
	if f.NodePort != 0 {
		fams := []netlink.InetFamily{unix.AF_INET, unix.AF_INET6}
		for _, fam := range fams {
			if len(out[fam]) == 0 && !(fam == unix.AF_INET && len(f.Addrs) == 0) {
				continue
			}
			cf, err := udpFilter(f.NodePort)
			if err != nil {
				return nil, fmt.Errorf("conntrack: filter for node port %d: %w", f.NodePort, err)
			}
			out[fam] = append(out[fam], narrow(cf, f))
		}
	}
	return out, nil
}

// replyFrom narrows a filter to the entries whose reply comes from one of ports (any address:
// a REDIRECT answers from the address the packet came in on; Flows.ProxyPorts) or endpoints
// (Flows.Endpoints).
type replyFrom struct {
	netlink.CustomConntrackFilter
	ports     []uint16
	endpoints []netip.AddrPort
}

func (r replyFrom) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	rv := flow.Reverse
	src, _ := netip.AddrFromSlice(rv.SrcIP)
	from := slices.Contains(r.ports, rv.SrcPort) || slices.Contains(r.endpoints, netip.AddrPortFrom(src.Unmap(), rv.SrcPort))
	return from && r.CustomConntrackFilter.MatchConntrackFlow(flow)
}

// narrow returns cf, narrowed to f's proxy ports and endpoints unless it has none.
func narrow(cf netlink.CustomConntrackFilter, f Flows) netlink.CustomConntrackFilter {
	if len(f.ProxyPorts) == 0 && len(f.Endpoints) == 0 {
		return cf
	}
	eps := make([]netip.AddrPort, len(f.Endpoints))
	for i, e := range f.Endpoints {
		eps[i] = netip.AddrPortFrom(e.Addr().Unmap(), e.Port())
	}
	return replyFrom{cf, slices.Clone(f.ProxyPorts), eps}
}

// udpFilter matches UDP entries with original destination port port.
func udpFilter(port uint16) (*netlink.ConntrackFilter, error) {
	cf := &netlink.ConntrackFilter{}
	if err := cf.AddProtocol(udpProto); err != nil {
		return nil, err
	}
	if err := cf.AddPort(netlink.ConntrackOrigDstPort, port); err != nil {
		return nil, err
	}
	return cf, nil
}

func familyOf(a netip.Addr) netlink.InetFamily {
	if a.Unmap().Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func familyName(fam netlink.InetFamily) string {
	if fam == unix.AF_INET6 {
		return "IPv6"
	}
	return "IPv4"
}

// describe names f in errors: "10.96.0.10:53 [fd00::a]:53 nodeport 30053".
func describe(f Flows) string {
	var parts []string
	for _, a := range f.Addrs {
		parts = append(parts, netip.AddrPortFrom(a, f.Port).String())
	}
	if f.NodePort != 0 {
		parts = append(parts, fmt.Sprintf("nodeport %d", f.NodePort))
	}
	if len(f.ProxyPorts) > 0 {
		parts = append(parts, fmt.Sprintf("via proxy ports %v", f.ProxyPorts))
	}
	if len(f.Endpoints) > 0 {
		parts = append(parts, fmt.Sprintf("to endpoints %v", f.Endpoints))
	}
	return strings.Join(parts, " ")
}
