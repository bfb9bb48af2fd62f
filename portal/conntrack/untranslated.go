package conntrack

// untranslated.go: after the nat table was flushed behind the proxy's back, the connections whose
// first packet passed before the repair have conntrack entries without NAT: the nat table is
// consulted only for a flow's first packet, so their retransmitted SYNs (and a UDP client's next
// datagrams) keep going untranslated, past the repaired portal rules, to nothing, until the
// client gives up. Deleting those entries makes the next packet a new flow that the rules steer:
// a SYN retransmitted a second later connects.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// untranslatedFilter matches TCP and UDP entries to one of the portal destinations of a set of
// service ports whose reply would come from that same destination: no portal rule translated
// them. It is one filter for every port, with a set lookup per entry: the kernel's table is
// walked once however many ports are given (a filter per port cost ports × entries, which at
// 10,000 service ports and a busy table is billions of comparisons).
type untranslatedFilter struct {
	dsts      map[netip.AddrPort]struct{}
	nodePorts map[uint16]struct{}
}

var _ netlink.CustomConntrackFilter = (*untranslatedFilter)(nil)

func newUntranslatedFilter(fs []Flows) *untranslatedFilter {
	u := &untranslatedFilter{dsts: map[netip.AddrPort]struct{}{}, nodePorts: map[uint16]struct{}{}}
	for _, f := range fs {
		for _, a := range f.Addrs {
			u.dsts[netip.AddrPortFrom(a.Unmap(), f.Port)] = struct{}{}
		}
		if f.NodePort != 0 {
			u.nodePorts[f.NodePort] = struct{}{}
		}
	}
	return u
}

func (u *untranslatedFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	fw, rv := flow.Forward, flow.Reverse
	if fw.Protocol != unix.IPPROTO_TCP && fw.Protocol != unix.IPPROTO_UDP {
		return false
	}
	if !rv.SrcIP.Equal(fw.DstIP) || rv.SrcPort != fw.DstPort {
		return false // translated
	}
	dst, ok := netip.AddrFromSlice(fw.DstIP)
	if !ok {
		return false
	}
	if _, ok := u.dsts[netip.AddrPortFrom(dst.Unmap(), fw.DstPort)]; ok {
		return true
	}
	_, ok = u.nodePorts[fw.DstPort]
	return ok
}

// ClearUntranslated deletes, in every family, the TCP and UDP entries to f's destinations that no
// portal rule translated (see the file comment). Entries already gone are not a failure.
func (n *Netlink) ClearUntranslated(ctx context.Context, fs []Flows) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if len(fs) == 0 {
		return nil
	}
	filter := newUntranslatedFilter(fs)
	run := func(fn func() error) error { return fn() }
	if n.Do != nil {
		run = n.Do
	}
	return run(func() error {
		h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
		if err != nil {
			return fmt.Errorf("conntrack: netlink handle: %w", err)
		}
		defer h.Close()
		var errs []error
		for _, fam := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
			if _, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, fam, filter); err != nil {
				errs = append(errs, fmt.Errorf("conntrack %s: delete untranslated entries of %d service ports: %w", familyName(fam), len(fs), err))
			}
		}
		return errors.Join(errs...)
	})
}
