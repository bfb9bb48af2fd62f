package transparent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Rule is an ip rule that sends packets with Mark (under Mask) to Table.
type Rule struct {
	Priority   int
	Mark, Mask uint32
	Table      int
}

// anyLocal is the destination of the local default route of a family.
func anyLocal(fam portal.Family) netip.Prefix {
	if fam == portal.IPv6 {
		return netip.MustParsePrefix("::/0")
	}
	return netip.MustParsePrefix("0.0.0.0/0")
}

func (n *Node) wantRule() Rule {
	return Rule{Priority: n.cfg.Preference, Mark: n.cfg.Mark, Mask: n.cfg.Mark, Table: n.cfg.Table}
}

// syncRouting adds `ip rule fwmark M/M lookup T pref P` and `local <any> dev lo table T` when
// missing: a marked reply is then delivered locally whatever its destination address, where the
// socket match found the transparent socket it belongs to.
func (n *Node) syncRouting(ctx context.Context, fam portal.Family) error {
	rules, err := n.cfg.Netlink.Rules(ctx, fam)
	if err != nil {
		return fmt.Errorf("list rules: %w", err)
	}
	want := n.wantRule()
	found := false
	for _, r := range rules {
		found = found || r == want
	}
	if !found {
		if err := n.cfg.Netlink.AddRule(ctx, fam, want); err != nil {
			return fmt.Errorf("add rule fwmark %#x/%#x lookup %d pref %d: %w", want.Mark, want.Mask, want.Table, want.Priority, err)
		}
	}
	routes, err := n.cfg.Netlink.LocalRoutes(ctx, fam, n.cfg.Table)
	if err != nil {
		return fmt.Errorf("list table %d: %w", n.cfg.Table, err)
	}
	dst := anyLocal(fam)
	for _, r := range routes {
		if r == dst {
			return nil
		}
	}
	if err := n.cfg.Netlink.AddLocalRoute(ctx, fam, n.cfg.Table, dst); err != nil {
		return fmt.Errorf("add route local %s dev lo table %d: %w", dst, n.cfg.Table, err)
	}
	return nil
}

// cleanupRouting removes every fwmark rule that leads to our table and every local route on lo in
// it.
func (n *Node) cleanupRouting(ctx context.Context, fam portal.Family) error {
	var errs []error
	rules, err := n.cfg.Netlink.Rules(ctx, fam)
	if err != nil {
		return fmt.Errorf("list rules: %w", err)
	}
	for _, r := range rules {
		if r.Table == n.cfg.Table && r.Mask != 0 {
			if err := n.cfg.Netlink.DeleteRule(ctx, fam, r); err != nil {
				errs = append(errs, fmt.Errorf("delete rule fwmark %#x/%#x lookup %d: %w", r.Mark, r.Mask, r.Table, err))
			}
		}
	}
	routes, err := n.cfg.Netlink.LocalRoutes(ctx, fam, n.cfg.Table)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("list table %d: %w", n.cfg.Table, err))...)
	}
	for _, dst := range routes {
		if err := n.cfg.Netlink.DeleteLocalRoute(ctx, fam, n.cfg.Table, dst); err != nil {
			errs = append(errs, fmt.Errorf("delete route local %s table %d: %w", dst, n.cfg.Table, err))
		}
	}
	return errors.Join(errs...)
}

// Installed reports, from netlink alone (no iptables or nft run), whether policy routing of every
// family is in place: the ip rule and the local route. A restarted proxy finds its predecessor's
// plumbing so and may dial transparently at once, before its first Sync has checked the rest.
func (n *Node) Installed(ctx context.Context) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	want := n.wantRule()
	for _, fam := range n.cfg.Families {
		rules, err := n.cfg.Netlink.Rules(ctx, fam)
		if err != nil || !slices.Contains(rules, want) {
			return false
		}
		routes, err := n.cfg.Netlink.LocalRoutes(ctx, fam, n.cfg.Table)
		if err != nil || !slices.Contains(routes, anyLocal(fam)) {
			return false
		}
	}
	return true
}
