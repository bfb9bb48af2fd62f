package conntrack

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// BenchmarkClearUDPKernel deletes the UDP conntrack entries of n service ports, one ClearUDP
// each (as the proxier does when ports go away), or of one port with n addresses, from a
// namespace's table that also holds n entries that stay (same addresses, port 54). The entries are made with conntrack -I, outside
// the timer. Cluster IPs 10.96.0.0/16, client 10.100.0.2.
//
//	go test -run XXX -bench BenchmarkClearUDPKernel -benchtime 5x ./portal/conntrack/
func BenchmarkClearUDPKernel(b *testing.B) {
	lab := netns.NewTestLab(b)
	node := lab.MustAdd(b, "node")
	for _, bc := range benchCases() {
		b.Run(bc.name, func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				fillConntrack(b, node, bc.addrs)
				b.StartTimer()
				if err := node.Do(func() error {
					c := &Netlink{}
					for _, f := range bc.flows {
						if err := c.ClearUDP(context.Background(), f); err != nil {
							return err
						}
					}
					return nil
				}); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				checkCleared(b, node, len(bc.addrs))
			}
		})
	}
}

type benchCase struct {
	name  string
	addrs []netip.Addr
	flows []Flows
}

// benchCases: n ports with one address each (ClearUDP per port), and one port with n addresses.
func benchCases() []benchCase {
	addrsOf := func(n int) []netip.Addr {
		out := make([]netip.Addr, n)
		for i := range out {
			out[i] = netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})
		}
		return out
	}
	var out []benchCase
	for _, n := range []int{10, 100} {
		c := benchCase{name: fmt.Sprintf("ports_%d", n), addrs: addrsOf(n)}
		for _, a := range c.addrs {
			c.flows = append(c.flows, Flows{Addrs: []netip.Addr{a}, Port: 53})
		}
		out = append(out, c)
	}
	a := addrsOf(100)
	return append(out, benchCase{name: "one_port_100_addrs", addrs: a, flows: []Flows{{Addrs: a, Port: 53}}})
}

// fillConntrack flushes the table and creates, per address, an entry to port 53 and one to 54.
func fillConntrack(b testing.TB, ns *netns.NS, addrs []netip.Addr) {
	b.Helper()
	var script strings.Builder
	script.WriteString("conntrack -F 2>/dev/null\n")
	for _, a := range addrs {
		for _, port := range []int{53, 54} {
			fmt.Fprintf(&script, "conntrack -I -p udp -s 10.100.0.2 -d %s --sport 40000 --dport %d --timeout 600 2>/dev/null || exit 1\n", a, port)
		}
	}
	ns.MustExec(b, "sh", "-c", script.String())
}

// checkCleared fails unless exactly the port-54 entries are left.
func checkCleared(b testing.TB, ns *netns.NS, n int) {
	b.Helper()
	out := ns.MustExec(b, "sh", "-c", "conntrack -L -p udp 2>/dev/null")
	if got53, got54 := strings.Count(out, "dport=53 "), strings.Count(out, "dport=54 "); got53 != 0 || got54 != n {
		b.Fatalf("after clearing: %d entries to port 53 (want 0) and %d to port 54 (want %d)", got53, got54, n)
	}
}
