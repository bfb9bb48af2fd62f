package conntrack

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan for the kernel test, all inside namespaces it creates: client 10.100.0.2 and
// fd00:100::2, node 10.100.0.1 and fd00:100::1 on a veth pair; the client routes the cluster
// ranges 10.96.0.0/16 and fd00:96::/112 via the node, whose nat PREROUTING REDIRECTs every UDP
// packet for them, and for node port 30053, to the proxy socket :34053, as the portal rules do.

const proxyPort = 34053

// udpLab is a client and a node namespace with UDP portals on the node.
type udpLab struct{ client, node *netns.NS }

func newUDPLab(t *testing.T) *udpLab {
	l := &udpLab{}
	l.client, l.node = netns.NewTestPair(t)
	ctx := t.Context()
	l.client.MustExec(t, "ip", "addr", "add", "fd00:100::2/64", "dev", "c0", "nodad")
	l.node.MustExec(t, "ip", "addr", "add", "fd00:100::1/64", "dev", "n0", "nodad")
	for _, r := range []struct{ dst, gw string }{{"10.96.0.0/16", "10.100.0.1"}, {"fd00:96::/112", "fd00:100::1"}} {
		if err := l.client.AddRoute(ctx, netip.MustParsePrefix(r.dst), netip.MustParseAddr(r.gw), ""); err != nil {
			t.Fatal(err)
		}
	}
	for _, cmd := range [][]string{
		{"iptables", "-t", "nat", "-A", "PREROUTING", "-d", "10.96.0.0/16", "-p", "udp", "-j", "REDIRECT", "--to-ports", fmt.Sprint(proxyPort)},
		{"iptables", "-t", "nat", "-A", "PREROUTING", "-p", "udp", "--dport", "30053", "-j", "REDIRECT", "--to-ports", fmt.Sprint(proxyPort)},
		{"ip6tables", "-t", "nat", "-A", "PREROUTING", "-d", "fd00:96::/112", "-p", "udp", "-j", "REDIRECT", "--to-ports", fmt.Sprint(proxyPort)},
	} {
		l.node.MustExec(t, cmd...)
	}
	var pc net.PacketConn
	if err := l.node.Do(func() (err error) {
		pc, err = net.ListenPacket("udp", fmt.Sprintf(":%d", proxyPort))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.EchoPackets(t, pc) // the proxy socket answers every datagram, so each entry is a two-way flow
	return l
}

// exchange sends one datagram from the client to dst and waits for the answer, which creates
// (or refreshes) the conntrack entry of that flow on the node.
func (l *udpLab) exchange(t *testing.T, dst string) {
	t.Helper()
	err := l.client.Do(func() error {
		c, err := net.Dial("udp", dst)
		if err != nil {
			return err
		}
		defer c.Close()
		if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
			return err
		}
		if _, err := c.Write([]byte("ping")); err != nil {
			return err
		}
		_, err = c.Read(make([]byte, 16))
		return err
	})
	if err != nil {
		t.Fatalf("UDP exchange with %s: %v", dst, err)
	}
}

// entries lists the node's UDP conntrack entries by original destination, sorted.
func (l *udpLab) entries(t *testing.T) []string {
	t.Helper()
	var out []string
	err := l.node.Do(func() error {
		for _, fam := range []netlink.InetFamily{unix.AF_INET, unix.AF_INET6} {
			flows, err := netlink.ConntrackTableList(netlink.ConntrackTable, fam)
			if err != nil {
				return err
			}
			for _, f := range flows {
				if f.Forward.Protocol != unix.IPPROTO_UDP {
					continue
				}
				a, _ := netip.AddrFromSlice(f.Forward.DstIP)
				out = append(out, netip.AddrPortFrom(a.Unmap(), f.Forward.DstPort).String())
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// TestNetlinkClearUDPKernel creates UDP conntrack entries with real traffic through NAT rules,
// clears one service port, and checks that exactly its entries are gone.
func TestNetlinkClearUDPKernel(t *testing.T) {
	l := newUDPLab(t)
	for _, dst := range []string{
		"10.96.0.10:53", "[fd00:96::a]:53", "10.96.1.7:53", "10.100.0.1:30053", // the port to clear
		"10.96.0.11:53", "10.96.0.10:54", "[fd00:96::b]:53", fmt.Sprintf("10.100.0.1:%d", proxyPort), // others
	} {
		l.exchange(t, dst)
	}
	before := []string{"10.100.0.1:30053", "10.100.0.1:34053", "10.96.0.10:53", "10.96.0.10:54", "10.96.0.11:53",
		"10.96.1.7:53", "[fd00:96::a]:53", "[fd00:96::b]:53"}
	if d := cmp.Diff(before, l.entries(t)); d != "" {
		t.Fatalf("entries before ClearUDP (-want +got):\n%s", d)
	}

	n := &Netlink{Do: l.node.Do}
	flows := Flows{Addrs: []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("10.96.1.7"),
		netip.MustParseAddr("fd00:96::a")}, Port: 53, NodePort: 30053}
	if err := n.ClearUDP(t.Context(), flows); err != nil {
		t.Fatal(err)
	}
	want := []string{"10.100.0.1:34053", "10.96.0.10:54", "10.96.0.11:53", "[fd00:96::b]:53"}
	if d := cmp.Diff(want, l.entries(t)); d != "" {
		t.Errorf("entries after ClearUDP (-want +got):\n%s", d)
	}
	// Nothing left to delete is not an error.
	if err := n.ClearUDP(t.Context(), flows); err != nil {
		t.Errorf("second ClearUDP: %v", err)
	}
}
