package testbed

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// The two-node address plan. The nodes share one link, the node network 172.31.0.0/24, where
// node k (1-based) is 172.31.0.k: that is its node IP. Pod j (1-based) of node k has its own
// link to its node, 10.244.(10k+j).0/24, the pod at .10 and the node at .1; each node routes the
// other node's pod links via the other node's IP and forwards between its links, so a pod on one
// node reaches a pod on the other with no NAT (as a CNI would). Cluster IPs (ClusterRange) exist
// only as portal rules in the node namespaces.
var (
	NodeNetwork = netip.MustParsePrefix("172.31.0.0/24")
)

// ClusterNodeIP is the node IP of node k (1-based) of a Cluster.
func ClusterNodeIP(k int) netip.Addr { return netip.AddrFrom4([4]byte{172, 31, 0, byte(k)}) }

// ClusterPodIP is the address of pod j of node k (both 1-based) of a Cluster.
func ClusterPodIP(k, j int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(10*k + j), 10}) }

func clusterPodGateway(k, j int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, 244, byte(10*k + j), 1})
}

// Cluster is two nodes, each with its pods, linked so that every namespace reaches every other.
type Cluster struct {
	Lab   *netns.Lab
	Nodes []*Node
}

// Node is one node namespace of a Cluster and the pods wired to it.
type Node struct {
	NS *netns.NS
	// Index is the node's 1-based number in the address plan.
	Index int
	// IP is the node IP (on the node network link).
	IP   netip.Addr
	Pods []*Pod
}

// clusterNodes is fixed: one veth pair links the two nodes.
const clusterNodes = 2

// NewCluster creates two node namespaces ("nodeA", "nodeB") with podsPerNode pods each. Pod j of
// node k is named "<a|b>-pod<j>" (what its backends greet with) and has ClusterPodIP(k, j).
func NewCluster(ctx context.Context, lab *netns.Lab, podsPerNode int) (*Cluster, error) {
	c := &Cluster{Lab: lab}
	for k := 1; k <= clusterNodes; k++ {
		letter := string(rune('a' + k - 1))
		ns, err := lab.Add(ctx, "node"+string(rune('A'+k-1)))
		if err != nil {
			return nil, err
		}
		n := &Node{NS: ns, Index: k, IP: ClusterNodeIP(k)}
		for j := 1; j <= podsPerNode; j++ {
			name := fmt.Sprintf("%s-pod%d", letter, j)
			pns, err := lab.Add(ctx, name)
			if err != nil {
				return nil, err
			}
			n.Pods = append(n.Pods, &Pod{NS: pns, Name: name, IP: ClusterPodIP(k, j)})
		}
		c.Nodes = append(c.Nodes, n)
	}
	a, b := c.Nodes[0], c.Nodes[1]
	if err := netns.Link(ctx,
		netns.End{NS: a.NS, Dev: "to-peer", Addr: netip.PrefixFrom(a.IP, NodeNetwork.Bits())},
		netns.End{NS: b.NS, Dev: "to-peer", Addr: netip.PrefixFrom(b.IP, NodeNetwork.Bits())}); err != nil {
		return nil, err
	}
	for _, n := range c.Nodes {
		if err := n.wire(ctx, c.peer(n)); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *Cluster) peer(n *Node) *Node {
	if n == c.Nodes[0] {
		return c.Nodes[1]
	}
	return c.Nodes[0]
}

// wire links n's pods to it, routes the peer's pods via the peer and turns forwarding on.
func (n *Node) wire(ctx context.Context, peer *Node) error {
	// ip_forward is per network namespace: this changes only the node namespace.
	if _, err := n.NS.Exec(ctx, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"); err != nil {
		return fmt.Errorf("node %s: forwarding: %w", n.NS.Name, err)
	}
	for j, p := range n.Pods {
		gw := clusterPodGateway(n.Index, j+1)
		if err := netns.Link(ctx,
			netns.End{NS: n.NS, Dev: fmt.Sprintf("to-pod%d", j+1), Addr: netip.PrefixFrom(gw, 24)},
			netns.End{NS: p.NS, Dev: "eth0", Addr: netip.PrefixFrom(p.IP, 24)}); err != nil {
			return err
		}
		if err := p.NS.AddRoute(ctx, netip.MustParsePrefix("0.0.0.0/0"), gw, "eth0"); err != nil {
			return err
		}
	}
	for _, p := range peer.Pods {
		if err := n.NS.AddRoute(ctx, netip.PrefixFrom(p.IP, 24).Masked(), peer.IP, "to-peer"); err != nil {
			return err
		}
	}
	// The node's own traffic to a service IP needs a route before OUTPUT's DNAT can apply (a real
	// node has a default route). Unmatched packets would only draw unanswered ARP on the node
	// network, which no one outside the two nodes shares.
	return n.NS.AddRoute(ctx, ClusterRange, netip.Addr{}, "to-peer")
}

// Pods returns every pod of every node, node by node.
func (c *Cluster) Pods() []*Pod {
	var out []*Pod
	for _, n := range c.Nodes {
		out = append(out, n.Pods...)
	}
	return out
}

// ServePods starts every pod's backends (see Pod.Serve); stop ends them and waits.
func (c *Cluster) ServePods(ctx context.Context, tcpPort, udpPort uint16) (stop func(), err error) {
	return servePods(ctx, c.Pods(), tcpPort, udpPort)
}
