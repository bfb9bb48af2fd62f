package conntrack

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// BenchmarkClearUntranslatedKernel walks a namespace's conntrack table of 2,000 UDP entries
// (made with conntrack -I, all translated, so none is deleted and the table stays) with
// ClearUntranslated for n service ports, as a nat repair or a start with n UDP ports does.
// Cluster IPs 10.96.0.0/16, client 10.100.0.2.
//
//	go test -run XXX -bench BenchmarkClearUntranslatedKernel -benchtime 20x ./portal/conntrack/
func BenchmarkClearUntranslatedKernel(b *testing.B) {
	lab := netns.NewTestLab(b)
	node := lab.MustAdd(b, "node")
	var script strings.Builder
	for i := range 2000 {
		// Translated: the reply comes from the proxy port, not from the service address.
		fmt.Fprintf(&script, "conntrack -I -p udp -s 10.100.0.2 -d 10.96.%d.%d --sport %d --dport 53 -r 10.100.0.1 -q 10.100.0.2 --reply-port-src 34000 --reply-port-dst %d --timeout 600 2>/dev/null || exit 1\n",
			i/250, i%250+1, 40000+i, 40000+i)
	}
	file := filepath.Join(b.TempDir(), "fill.sh")
	if err := os.WriteFile(file, []byte(script.String()), 0o600); err != nil {
		b.Fatal(err)
	}
	node.MustExec(b, "sh", file)
	for _, n := range []int{100, 10000} {
		flows := make([]Flows, n)
		for i := range flows {
			flows[i] = Flows{Addrs: []netip.Addr{netip.AddrFrom4([4]byte{10, 97, byte(i / 250), byte(i%250 + 1)})}, Port: 53, NodePort: uint16(30000 + i%2700)}
		}
		b.Run(fmt.Sprintf("ports_%d", n), func(b *testing.B) {
			c := &Netlink{Do: node.Do}
			for b.Loop() {
				if err := c.ClearUntranslated(b.Context(), flows); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	if got := strings.Count(node.MustExec(b, "sh", "-c", "conntrack -L -p udp 2>/dev/null"), "dport=53 "); got != 2000 {
		b.Fatalf("%d entries left, want all 2000 (none was untranslated)", got)
	}
}
