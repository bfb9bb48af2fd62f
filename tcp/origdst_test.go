package tcp

import (
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// TestProxyProtocolDestinationIsTheAddressBeforeRedirect: behind an iptables REDIRECT, as in the
// portal rules, the PROXY header names the address the client dialled (conntrack's original
// destination), not the proxy port the rule sent the connection to; IPv4 and IPv6.
//
// Address plan: in a throwaway namespace with only lo, the client dials the "service"
// 127.0.0.10:80 (IPv6: [::1]:80), which a nat OUTPUT rule redirects to the proxy on 127.0.0.1:P
// ([::1]:P). The rule lives only in that namespace. The proxy's listener and the client are in
// the namespace; its dials run on other threads, in the root namespace, so the endpoint listens
// on the root namespace's loopback (127.0.0.3, ::1).
func TestProxyProtocolDestinationIsTheAddressBeforeRedirect(t *testing.T) {
	ns := netns.NewTestLab(t).MustAdd(t, "origdst")
	for _, tc := range []struct {
		family, tool, proxyIP, serviceIP, endpointIP string
	}{
		{"ipv4", "iptables", "127.0.0.1", "127.0.0.10", "127.0.0.3"},
		{"ipv6", "ip6tables", "::1", "::1", "::1"},
	} {
		t.Run(tc.family, func(t *testing.T) {
			if _, err := exec.LookPath(tc.tool); err != nil {
				testenv.Unavailable(t, "%s not installed", tc.tool)
			}
			if tc.family == "ipv6" {
				if ln, err := net.Listen("tcp6", "[::1]:0"); err != nil {
					testenv.Unavailable(t, "no IPv6 loopback here: %v", err)
				} else {
					ln.Close()
				}
			}
			got := make(chan proxyprotocol.Header, 1)
			ep := serve(t, tc.endpointIP, headerEcho(got))
			p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Logger: testLogger(t), ProxyProtocol: proxyprotocol.V1})
			if err := ns.Do(func() error { return p.Listen(netip.AddrPortFrom(netip.MustParseAddr(tc.proxyIP), 0)) }); err != nil {
				t.Fatalf("listen in the namespace: %v", err)
			}
			go p.Run(t.Context())
			defer p.Shutdown()
			service := netip.AddrPortFrom(netip.MustParseAddr(tc.serviceIP), 80)
			if out, err := ns.Exec(t.Context(), tc.tool, "-w", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", tc.serviceIP,
				"--dport", "80", "-j", "REDIRECT", "--to-ports", fmt.Sprint(p.Addr().Port())); err != nil {
				testenv.Unavailable(t, "%s nat REDIRECT in a namespace: %v %s", tc.tool, err, out)
			}
			var c net.Conn
			if err := ns.Do(func() error {
				var err error
				c, err = net.DialTimeout("tcp", service.String(), 5*time.Second)
				return err
			}); err != nil {
				t.Fatalf("dial %s in the namespace: %v", service, err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			roundTrip(t, c.(*net.TCPConn), "through the redirect")
			want := proxyprotocol.Header{Source: c.LocalAddr().(*net.TCPAddr).AddrPort(), Destination: service}
			if h := <-got; h != want {
				t.Errorf("header %+v, want %+v (the service address, not the proxy's %s)", h, want, p.Addr())
			}
		})
	}
}
