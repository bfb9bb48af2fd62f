package transparent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// nftInet writes the inet table: the proxy's transparent connections get the mark on their
// conntrack entry once, as their first packet leaves (chain NFTConnChain, output), and every
// reply of theirs gets it from there (chain NFTMarkChain, prerouting, priority mangle). Native
// nft expressions, not iptables' xt compat matches (conntrack, socket, CONNMARK): those run
// through nft_compat on iptables-nft nodes, at a cost per packet and with the xtables lock on
// every write.
//
// On output the packet carries its socket, so "socket transparent 1" reads a flag of it, no
// lookup, and only for a connection's first packet ("ct state new"). A reply then costs a test of
// its entry's mark: no socket lookup per reply packet of every flow of the node, which a rule
// "ct direction reply socket transparent 1" in prerouting paid (a hash lookup for each, about
// 5% more CPU per new connection through the proxy than without the plumbing, 21 rounds of
// bench/flows). Both marks are or-ed in, keeping others' bits.
func (n *Node) nftInet(b *bytes.Buffer) {
	only := ""
	if len(n.cfg.Families) == 1 {
		only = "meta nfproto ipv4 "
		if n.cfg.Families[0] == portal.IPv6 {
			only = "meta nfproto ipv6 "
		}
	}
	m := n.cfg.Mark
	fmt.Fprintf(b, "table inet %s\ndelete table inet %s\ntable inet %s {\n", NFTTable, NFTTable, NFTTable)
	fmt.Fprintf(b, "\tchain %s {\n\t\ttype filter hook output priority mangle; policy accept;\n", NFTConnChain)
	fmt.Fprintf(b, "\t\t%sct state new socket transparent 1 ct mark set ct mark | %#08x\n\t}\n", only, m)
	fmt.Fprintf(b, "\tchain %s {\n\t\ttype filter hook prerouting priority mangle; policy accept;\n", NFTMarkChain)
	fmt.Fprintf(b, "\t\t%sct direction reply ct mark & %#08x == %#08x meta mark set meta mark | %#08x\n\t}\n}\n", only, m, m, m)
}

// nftBridge writes the bridge table. The chain runs at priority 100, after br_netfilter
// (priority 0), which has run the inet prerouting hooks for the bridged frame, so the mark is
// already on it. Only marked frames (replies to the proxy's transparent sockets) are rewritten:
// pod-to-pod traffic keeps being bridged.
func (n *Node) nftBridge(b *bytes.Buffer) {
	fmt.Fprintf(b, "table bridge %s\ndelete table bridge %s\ntable bridge %s {\n", NFTTable, NFTTable, NFTTable)
	fmt.Fprintf(b, "\tchain %s {\n\t\ttype filter hook prerouting priority 100; policy accept;\n", NFTChain)
	for _, fam := range n.cfg.Families {
		etype := "ip"
		if fam == portal.IPv6 {
			etype = "ip6"
		}
		fmt.Fprintf(b, "\t\tmeta mark & %#08x == %#08x ether type %s ether daddr set %s meta pkttype set host\n",
			n.cfg.Mark, n.cfg.Mark, etype, n.cfg.BridgeMAC)
	}
	b.WriteString("\t}\n}\n")
}

// listTable returns `nft list table family NFTTable`, and false when there is no such table.
func (n *Node) listTable(ctx context.Context, family string) (string, bool, error) {
	out, err := n.cfg.Runner.NFT(ctx, nil, "list", "table", family, NFTTable)
	if ee, ok := errors.AsType[*iptables.ExitError](err); ok && strings.Contains(ee.Stderr, "No such file or directory") {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("nft list table %s %s: %w", family, NFTTable, err)
	}
	return string(out), true, nil
}

// syncNFT writes both tables, in one transaction, unless each is as we last read it back (nft
// prints rules its own way, so what was read back after our write is what is compared). Each
// table is declared, deleted and declared again, so a table someone changed is replaced, never
// merged. The inet table is required: its failure is err. The bridge table is optional: a
// kernel without the nft bridge family fails the transaction, which is then written again with
// the inet table alone, and bridgeErr says why; it is not tried again until Cleanup, so a Sync on
// such a node writes nothing either.
func (n *Node) syncNFT(ctx context.Context) (bridgeErr, err error) {
	inet, okInet, err := n.listTable(ctx, "inet")
	if err != nil {
		return nil, err
	}
	bridge, okBridge := "", false
	if n.bridgeErr == nil {
		if bridge, okBridge, err = n.listTable(ctx, "bridge"); err != nil {
			return nil, err
		}
	}
	if okInet && n.nftInetRead != "" && inet == n.nftInetRead &&
		(n.bridgeErr != nil || okBridge && n.nftBridgeRead != "" && bridge == n.nftBridgeRead) {
		return n.bridgeErr, nil
	}
	n.nftInetRead, n.nftBridgeRead = "", ""
	var b bytes.Buffer
	n.nftInet(&b)
	inetOnly := b.Len()
	werr := error(nil)
	if n.bridgeErr == nil {
		n.nftBridge(&b)
		werr = n.writeNFT(ctx, b.Bytes())
		if werr != nil {
			n.bridgeErr = werr
		}
	}
	if n.bridgeErr != nil {
		if err := n.writeNFT(ctx, b.Bytes()[:inetOnly]); err != nil {
			if werr != nil {
				// The inet table alone fails too: the bridge table may be fine.
				n.bridgeErr = nil
			}
			return nil, err
		}
	}
	if n.nftInetRead, _, err = n.listTable(ctx, "inet"); err != nil {
		return nil, err
	}
	if n.bridgeErr == nil {
		if n.nftBridgeRead, _, err = n.listTable(ctx, "bridge"); err != nil {
			return nil, err
		}
	}
	return n.bridgeErr, nil
}

func (n *Node) writeNFT(ctx context.Context, ruleset []byte) error {
	if _, err := n.cfg.Runner.NFT(ctx, ruleset, "-f", "-"); err != nil {
		return fmt.Errorf("nft -f -: %w", err)
	}
	return nil
}

// cleanupNFT deletes whichever of our tables exist, in one transaction (declaring a bridge table
// to delete it would fail on a kernel without the bridge family). No nft: nothing of ours can be
// there.
func (n *Node) cleanupNFT(ctx context.Context) error {
	out, err := n.cfg.Runner.NFT(ctx, nil, "list", "tables")
	if errors.Is(err, iptables.ErrUnavailable) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("transparent: nft list tables: %w", err)
	}
	var del strings.Builder
	for _, line := range strings.Split(string(out), "\n") {
		for _, family := range []string{"inet", "bridge"} {
			if strings.TrimSpace(line) == "table "+family+" "+NFTTable {
				fmt.Fprintf(&del, "delete table %s %s\n", family, NFTTable)
			}
		}
	}
	if del.Len() == 0 {
		return nil
	}
	if err := n.writeNFT(ctx, []byte(del.String())); err != nil {
		return fmt.Errorf("transparent: delete nft tables %s: %w", NFTTable, err)
	}
	return nil
}
