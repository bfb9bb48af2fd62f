package conntrack

import (
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestNetlinkClearUntranslatedKernel: of the entries to a service port's destinations, only those
// no portal rule translated are deleted. Address plan: newUDPLab's; node port 30053 is redirected
// to the proxy socket, node port 30099 is not (as after a nat flush: the datagram is delivered to
// the node untranslated, and its entry would pin the flow so).
func TestNetlinkClearUntranslatedKernel(t *testing.T) {
	l := newUDPLab(t)
	l.exchange(t, "10.96.0.10:53")    // translated (REDIRECT), answered by the proxy socket
	l.exchange(t, "10.100.0.1:30053") // translated
	l.sendOnly(t, "10.100.0.1:30099") // untranslated: nothing listens, but the entry exists
	before := []string{"10.100.0.1:30053", "10.100.0.1:30099", "10.96.0.10:53"}
	if d := cmp.Diff(before, l.entries(t)); d != "" {
		t.Fatalf("entries before (-want +got):\n%s", d)
	}
	n := &Netlink{Do: l.node.Do}
	err := n.ClearUntranslated(t.Context(), []Flows{
		{Addrs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}, Port: 53, NodePort: 30053},
		{NodePort: 30099},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.100.0.1:30053", "10.96.0.10:53"}
	if d := cmp.Diff(want, l.entries(t)); d != "" {
		t.Errorf("entries after ClearUntranslated (-want +got):\n%s", d)
	}
}

// sendOnly sends one datagram from the client to dst and does not wait for an answer.
func (l *udpLab) sendOnly(t *testing.T, dst string) {
	t.Helper()
	err := l.client.Do(func() error {
		c, err := net.Dial("udp", dst)
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write([]byte("ping"))
		return err
	})
	if err != nil {
		t.Fatalf("UDP to %s: %v", dst, err)
	}
	// The entry is confirmed when the node delivers the datagram.
	testenv.WaitFor(t, "the conntrack entry of "+dst, func() bool { return slices.Contains(l.entries(t), dst) })
}
