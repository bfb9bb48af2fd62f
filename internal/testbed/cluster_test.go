package testbed

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// TestClusterLinks checks the two-node address plan with no proxy: pod 1 of node k is
// ClusterPodIP(k, 1) (10.244.11.10 on node A, 10.244.21.10 on node B), the nodes are
// 172.31.0.1 and 172.31.0.2, and every namespace reaches every pod directly, across nodes too.
func TestClusterLinks(t *testing.T) {
	lab := netns.NewTestLab(t)
	c, err := NewCluster(t.Context(), lab, 2)
	if err != nil {
		t.Fatal(err)
	}
	stop, err := c.ServePods(t.Context(), 8080, 5353)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	a, b := c.Nodes[0], c.Nodes[1]
	if a.IP != netip.MustParseAddr("172.31.0.1") || b.Pods[0].IP != netip.MustParseAddr("10.244.21.10") {
		t.Fatalf("address plan: node A %s, pod b-pod1 %s", a.IP, b.Pods[0].IP)
	}
	for _, tc := range []struct {
		name string
		from *netns.NS
		to   *Pod
	}{
		{"pod to pod on the same node", a.Pods[1].NS, a.Pods[0]},
		{"pod to pod across nodes", a.Pods[1].NS, b.Pods[0]},
		{"pod to pod across nodes, the other way", b.Pods[1].NS, a.Pods[0]},
		{"node to a pod of the other node", a.NS, b.Pods[1]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tcp, err := Who(tc.from, netip.AddrPortFrom(tc.to.IP, 8080), 2*time.Second)
			if err != nil || tcp != tc.to.Name {
				t.Errorf("TCP to %s: %q, %v; want %q", tc.to.IP, tcp, err, tc.to.Name)
			}
			udp, err := WhoUDP(tc.from, netip.AddrPortFrom(tc.to.IP, 5353), 2*time.Second)
			if err != nil || udp != tc.to.Name {
				t.Errorf("UDP to %s: %q, %v; want %q", tc.to.IP, udp, err, tc.to.Name)
			}
		})
	}
	t.Run("pod to the other node's IP", func(t *testing.T) {
		// The node IP is what node ports and host-network endpoints use.
		srv := &Pod{NS: b.NS, Name: "node-b", IP: b.IP}
		ctx, cancel := context.WithCancel(t.Context())
		wait, err := srv.Serve(ctx, 10180, 10180)
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		defer func() { cancel(); wait() }()
		if got, err := Who(a.Pods[1].NS, netip.AddrPortFrom(b.IP, 10180), 2*time.Second); err != nil || got != "node-b" {
			t.Errorf("TCP to %s: %q, %v", b.IP, got, err)
		}
	})
}
