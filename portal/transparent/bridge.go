package transparent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// nftRuleset is the whole bridge table, written in one transaction that creates the table if
// missing, deletes it and declares it again, so a table someone changed is replaced, never
// merged. The chain runs at priority 100, after br_netfilter (priority 0), which has run the
// inet PREROUTING hooks for the bridged frame, so the socket match's mark is already on it. Only
// marked frames (replies to the proxy's transparent sockets) are rewritten: pod-to-pod traffic
// keeps being bridged.
func (n *Node) nftRuleset() []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "table bridge %s\ndelete table bridge %s\ntable bridge %s {\n", NFTTable, NFTTable, NFTTable)
	fmt.Fprintf(&b, "\tchain %s {\n\t\ttype filter hook prerouting priority 100; policy accept;\n", NFTChain)
	for _, fam := range n.cfg.Families {
		etype := "ip"
		if fam == portal.IPv6 {
			etype = "ip6"
		}
		fmt.Fprintf(&b, "\t\tmeta mark & %#08x == %#08x ether type %s ether daddr set %s meta pkttype set host\n",
			n.cfg.Mark, n.cfg.Mark, etype, n.cfg.BridgeMAC)
	}
	b.WriteString("\t}\n}\n")
	return b.Bytes()
}

func (n *Node) listNFT(ctx context.Context) (string, bool, error) {
	out, err := n.cfg.Runner.NFT(ctx, nil, "list", "table", "bridge", NFTTable)
	if ee, ok := errors.AsType[*iptables.ExitError](err); ok && strings.Contains(ee.Stderr, "No such file or directory") {
		return "", false, nil
	}
	if err != nil {
		return "", false, err
	}
	return string(out), true, nil
}

// syncBridge writes the nft table unless it is as we last read it back, and gives every bridge
// of the node the local fdb entry for BridgeMAC (a CNI creates its bridge when the first pod
// starts, so each Sync looks again).
func (n *Node) syncBridge(ctx context.Context) error {
	have, ok, err := n.listNFT(ctx)
	if err != nil {
		return fmt.Errorf("nft list table bridge %s: %w", NFTTable, err)
	}
	if !ok || n.nft == "" || have != n.nft {
		if _, err := n.cfg.Runner.NFT(ctx, n.nftRuleset(), "-f", "-"); err != nil {
			n.nft = ""
			return fmt.Errorf("nft table bridge %s: %w", NFTTable, err)
		}
		if n.nft, _, err = n.listNFT(ctx); err != nil {
			return fmt.Errorf("nft list table bridge %s: %w", NFTTable, err)
		}
	}
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

func (n *Node) cleanupBridge(ctx context.Context) error {
	var errs []error
	_, err := n.cfg.Runner.NFT(ctx, []byte(fmt.Sprintf("table bridge %s\ndelete table bridge %s\n", NFTTable, NFTTable)), "-f", "-")
	if err != nil && !errors.Is(err, iptables.ErrUnavailable) {
		errs = append(errs, fmt.Errorf("transparent: delete nft table bridge %s: %w", NFTTable, err))
	}
	bridges, err := n.cfg.Netlink.Bridges(ctx, n.cfg.BridgeMAC)
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("transparent: list bridges: %w", err))...)
	}
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
// network namespace: without it the socket match never sees a bridged reply.
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
