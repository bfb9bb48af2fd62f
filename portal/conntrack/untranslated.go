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

// untranslatedFilter matches TCP and UDP entries to one of a service port's portal destinations
// whose reply would come from that same destination: no portal rule translated them.
type untranslatedFilter struct {
	addrs    map[netip.Addr]bool
	port     uint16
	nodePort uint16
}

var _ netlink.CustomConntrackFilter = (*untranslatedFilter)(nil)

func (u *untranslatedFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	fw, rv := flow.Forward, flow.Reverse
	if fw.Protocol != unix.IPPROTO_TCP && fw.Protocol != unix.IPPROTO_UDP {
		return false
	}
	dst, ok := netip.AddrFromSlice(fw.DstIP)
	if !ok {
		return false
	}
	portal := (u.addrs[dst.Unmap()] && fw.DstPort == u.port) || (u.nodePort != 0 && fw.DstPort == u.nodePort)
	return portal && rv.SrcIP.Equal(fw.DstIP) && rv.SrcPort == fw.DstPort
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
	filters := make([]netlink.CustomConntrackFilter, 0, len(fs))
	for _, f := range fs {
		u := &untranslatedFilter{addrs: map[netip.Addr]bool{}, port: f.Port, nodePort: f.NodePort}
		for _, a := range f.Addrs {
			u.addrs[a.Unmap()] = true
		}
		filters = append(filters, u)
	}
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
			if _, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, fam, filters...); err != nil {
				errs = append(errs, fmt.Errorf("conntrack %s: delete untranslated entries of %d service ports: %w", familyName(fam), len(fs), err))
			}
		}
		return errors.Join(errs...)
	})
}
