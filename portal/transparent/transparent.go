// Package transparent installs the node plumbing of the transparent source mode: the proxy dials an
// endpoint from a socket with IP_TRANSPARENT bound to the client's address, and the rules here steer
// the endpoint's replies back into that socket (an nft socket expression that marks them, policy
// routing that delivers marked packets locally, and, for replies bridged between two pods of this
// node, an nft bridge rule that hands marked frames up to the node instead of bridging them).
// It uses nft only, no iptables: Cleanup still removes the iptables chain of an earlier build.
package transparent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Defaults. The mark bit avoids kube-proxy's 0x4000 (masquerade) and 0x8000 (drop); the table
// number and rule preference are unused by the usual CNIs and systemd.
const (
	DefaultMark       uint32 = 0x00100000
	DefaultTable             = 27504
	DefaultPreference        = 27504
	// NFTTable names both nft tables: the inet one, whose chain NFTMarkChain marks the replies,
	// and the bridge one, whose chain NFTChain hands marked bridged frames up to the node.
	NFTTable     = "kube-portal-proxy"
	NFTMarkChain = "transparent-mark"
	// NFTConnChain marks the conntrack entry of each of the proxy's transparent connections.
	NFTConnChain = "transparent-conn"
	NFTChain     = "transparent-replies"
)

// DefaultBridgeMAC is the address marked bridged frames are rewritten to. Every bridge of the node
// gets a permanent local fdb entry for it, so the bridge passes such a frame up to the node's IP
// stack whichever bridge it is on: the bridge's own address would need one rule per bridge,
// matched with "meta ibrname" (not every kernel has it: CONFIG_NFT_BRIDGE_META), and it changes
// when the bridge takes a port's address as ports come and go. 02:6b:70:70 is "kpp", locally
// administered.
var DefaultBridgeMAC = net.HardwareAddr{0x02, 0x6b, 0x70, 0x70, 0x00, 0x01}

// Config is what the node plumbing needs. Zero fields take the defaults.
type Config struct {
	// Mark is the packet mark bit (used as both value and mask) that the reply mark sets.
	Mark uint32
	// Table is the routing table that holds the local default routes; Preference the priority of
	// the ip rule that sends marked packets to it.
	Table      int
	Preference int
	// BridgeMAC is the destination marked bridged frames are rewritten to (DefaultBridgeMAC).
	BridgeMAC net.HardwareAddr
	// Families are the IP families to install; empty means both.
	Families []portal.Family
	Logger   logrus.FieldLogger
	// Runner runs nft; Netlink does the rest.
	Runner  Runner
	Netlink Netlink
}

func (c Config) withDefaults() Config {
	if c.Mark == 0 {
		c.Mark = DefaultMark
	}
	if c.Table == 0 {
		c.Table = DefaultTable
	}
	if c.Preference == 0 {
		c.Preference = DefaultPreference
	}
	if len(c.BridgeMAC) == 0 {
		c.BridgeMAC = DefaultBridgeMAC
	}
	if len(c.Families) == 0 {
		c.Families = portal.Families
	}
	if c.Logger == nil {
		c.Logger = portal.DiscardLogger()
	}
	return c
}

// Support is what the last Sync found the node can do.
type Support struct {
	// Socket: the nft inet table marks replies; PolicyRouting: marked packets are delivered locally.
	// Both hold for every family of Families, or Sync failed.
	Socket, PolicyRouting bool
	Families              []portal.Family
	// Bridge says that replies bridged between two pods of this node are caught too, for every
	// family of BridgeFamilies: the nft bridge table is in place and br_netfilter hands bridged
	// packets of that family to the inet hooks (bridge-nf-call-iptables / -ip6tables is 1).
	Bridge         bool
	BridgeFamilies []portal.Family
	// NoBridges: the node has no bridge with a port, so no reply is bridged between two of its
	// pods (a routed CNI, a veth per pod): the bridge part is not needed, whatever Bridge says.
	NoBridges bool
	// Reason says why something is not supported, for the log line and a metric label: "no nft
	// socket expression", "no policy routing", "no CAP_NET_ADMIN", "no nft", "no nft bridge family",
	// "br_netfilter off", "br_netfilter not loaded", joined by ", " when several; "" when all is.
	Reason string
}

// BridgeFor reports whether bridged replies of fam are caught.
func (s Support) BridgeFor(fam portal.Family) bool { return slices.Contains(s.BridgeFamilies, fam) }

// Node installs and repairs the plumbing. Safe for concurrent use.
type Node struct {
	cfg Config

	mu sync.Mutex
	// probed is set by the first Sync that installed the reply mark and policy routing; until
	// then a failure removes everything, so an unsupported node is left as it was.
	probed bool
	// nftInetRead and nftBridgeRead are `nft list table` of each table after our last write.
	nftInetRead, nftBridgeRead string
	// bridgeErr is why the bridge table could not be written, kept until Cleanup.
	bridgeErr error
	// bridgesWithPorts are the bridges with a port the last Sync saw (BridgesChanged).
	bridgesWithPorts []int
}

// New returns the plumbing for cfg. It touches nothing.
func New(cfg Config) *Node {
	return &Node{cfg: cfg.withDefaults()}
}

// Sync installs what is missing and repairs what others changed; with nothing changed it only
// reads (two nft lists, a few netlink dumps). The reply mark (the nft inet table) and policy
// routing are required: if either cannot be installed Sync returns an error naming it, and
// on the first Sync (the probe) it also removes whatever it installed. The bridge part is
// optional: its failure shows in Support only.
func (n *Node) Sync(ctx context.Context) (Support, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var reasons []string
	var joined []error
	bridgeErr, err := n.syncNFT(ctx)
	if err != nil {
		joined = append(joined, fmt.Errorf("transparent: reply mark (nft table inet %s): %w", NFTTable, err))
		reasons = append(reasons, reasonFor(err, "no nft socket expression"))
	}
	for _, fam := range n.cfg.Families {
		if err := n.syncRouting(ctx, fam); err != nil {
			joined = append(joined, fmt.Errorf("transparent %s: policy routing: %w", fam, err))
			reasons = append(reasons, reasonFor(err, "no policy routing"))
		}
	}
	if len(joined) > 0 {
		err := errors.Join(joined...)
		if !n.probed {
			if cerr := n.cleanupLocked(ctx); cerr != nil {
				err = errors.Join(err, fmt.Errorf("transparent: remove after failed probe: %w", cerr))
			}
		}
		return Support{Reason: joinReasons(reasons)}, err
	}
	n.probed = true
	sup := Support{Socket: true, PolicyRouting: true, Families: slices.Clone(n.cfg.Families)}
	if brs, err := n.cfg.Netlink.Bridges(ctx, n.cfg.BridgeMAC); err == nil {
		sup.NoBridges = !slices.ContainsFunc(brs, func(b Bridge) bool { return b.Ports > 0 })
	}
	n.bridgesWithPorts, _ = n.cfg.Netlink.BridgesWithPorts(ctx)
	if bridgeErr != nil {
		n.cfg.Logger.WithError(bridgeErr).Debug("Transparent bridge part not installed")
		reasons = append(reasons, reasonFor(bridgeErr, "no nft bridge family"))
	} else if err := n.syncFDB(ctx); err != nil {
		n.cfg.Logger.WithError(err).Debug("Transparent bridge part not installed")
		reasons = append(reasons, reasonFor(err, "no bridge fdb entry"))
	} else {
		for _, fam := range n.cfg.Families {
			on, why := n.brNetfilter(ctx, fam)
			if !on {
				reasons = append(reasons, why)
				continue
			}
			sup.BridgeFamilies = append(sup.BridgeFamilies, fam)
		}
		sup.Bridge = len(sup.BridgeFamilies) == len(n.cfg.Families)
	}
	sup.Reason = joinReasons(reasons)
	return sup, nil
}

// BridgesChanged reports whether the node's bridges with a port differ from what the last Sync
// saw: a CNI creates its bridge (cni0) when the first pod starts, and until a Sync gives it the
// fdb entry, replies bridged between two of its pods would reach the client pod instead of the
// proxy. One link dump: the caller asks every second and Syncs at once on a change.
func (n *Node) BridgesChanged(ctx context.Context) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	now, err := n.cfg.Netlink.BridgesWithPorts(ctx)
	return err == nil && !slices.Equal(now, n.bridgesWithPorts)
}

// Cleanup removes everything of ours, both families, whatever the configuration installed: the
// two nft tables, the bridges' fdb entries, the fwmark rules to the table and its local routes,
// and an earlier build's iptables mangle chain LegacyChain with every jump to it. Nothing to remove is not an error; a missing binary skips its
// part. It carries on after a failure and returns them all.
func (n *Node) Cleanup(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cleanupLocked(ctx)
}

func (n *Node) cleanupLocked(ctx context.Context) error {
	var errs []error
	if err := n.cleanupNFT(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := n.cleanupFDB(ctx); err != nil {
		errs = append(errs, err)
	}
	for _, fam := range portal.Families {
		if err := n.cleanupLegacy(ctx, fam); err != nil {
			errs = append(errs, fmt.Errorf("transparent %s: remove mangle %s: %w", fam, LegacyChain, err))
		}
		if err := n.cleanupRouting(ctx, fam); err != nil {
			errs = append(errs, fmt.Errorf("transparent %s: remove policy routing: %w", fam, err))
		}
	}
	n.probed = false
	n.nftInetRead, n.nftBridgeRead, n.bridgeErr = "", "", nil
	return errors.Join(errs...)
}

func joinReasons(rs []string) string {
	var out []string
	for _, r := range rs {
		if !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	return strings.Join(out, ", ")
}
