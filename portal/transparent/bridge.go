package transparent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// syncFDB gives every bridge of the node the local fdb entry for BridgeMAC (a CNI creates its
// bridge when the first pod starts, so each Sync looks again).
func (n *Node) syncFDB(ctx context.Context) error {
	bridges, err := n.cfg.Netlink.Bridges(ctx, n.cfg.BridgeMAC)
	if err != nil {
		return fmt.Errorf("list bridges: %w", err)
	}
	var errs []error
	for _, br := range bridges {
		if br.HasMAC {
			continue
		}
		if err := n.cfg.Netlink.AddFDB(ctx, br.Index, n.cfg.BridgeMAC); err != nil {
			errs = append(errs, fmt.Errorf("bridge %s: add local fdb entry %s: %w", br.Name, n.cfg.BridgeMAC, err))
		}
	}
	return errors.Join(errs...)
}

// cleanupFDB removes the fdb entry for BridgeMAC from every bridge that has it.
func (n *Node) cleanupFDB(ctx context.Context) error {
	bridges, err := n.cfg.Netlink.Bridges(ctx, n.cfg.BridgeMAC)
	if err != nil {
		return fmt.Errorf("transparent: list bridges: %w", err)
	}
	var errs []error
	for _, br := range bridges {
		if !br.HasMAC {
			continue
		}
		if err := n.cfg.Netlink.DeleteFDB(ctx, br.Index, n.cfg.BridgeMAC); err != nil {
			errs = append(errs, fmt.Errorf("transparent: bridge %s: delete fdb entry %s: %w", br.Name, n.cfg.BridgeMAC, err))
		}
	}
	return errors.Join(errs...)
}

// brNetfilter reports whether br_netfilter hands bridged packets of fam to ip(6)tables in this
// network namespace: without it the inet prerouting hook, and so the reply mark, never sees a
// bridged reply.
func (n *Node) brNetfilter(ctx context.Context, fam portal.Family) (bool, string) {
	name := "bridge-nf-call-iptables"
	if fam == portal.IPv6 {
		name = "bridge-nf-call-ip6tables"
	}
	v, err := n.cfg.Netlink.Sysctl(ctx, "net/bridge/"+name)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return false, "br_netfilter not loaded"
	case err != nil:
		return false, "br_netfilter unknown"
	case strings.TrimSpace(v) != "1":
		return false, "br_netfilter off"
	}
	return true, ""
}
