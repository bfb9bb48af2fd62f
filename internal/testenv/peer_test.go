package testenv

import (
	"net"
	"net/netip"
	"testing"
	"time"
)

func TestParsePeer(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want netip.AddrPort
		bad  bool
	}{
		{in: "10.244.21.10 40123\n", want: netip.MustParseAddrPort("10.244.21.10:40123")},
		{in: "fd00:30::2 5\n", want: netip.MustParseAddrPort("[fd00:30::2]:5")},
		// socat writes IPv6 in brackets, in full.
		{in: "[fd00:0030:0000:0000:0000:0000:0000:0002] 5", want: netip.MustParseAddrPort("[fd00:30::2]:5")},
		{in: "::ffff:10.0.0.1 7", want: netip.MustParseAddrPort("10.0.0.1:7")},
		{in: "10.0.0.1:7", bad: true},
		{in: "10.0.0.1 70000", bad: true},
		{in: "", bad: true},
	} {
		got, err := ParsePeer(tt.in)
		if tt.bad {
			if err == nil {
				t.Errorf("ParsePeer(%q) = %v, want an error", tt.in, got)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParsePeer(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

// TestPeerBackends runs both peer backends on loopback: each answers with the client socket's own
// address and port, over IPv4 and IPv6.
func TestPeerBackends(t *testing.T) {
	for _, ip := range []string{"127.0.0.1", "::1"} {
		t.Run(ip, func(t *testing.T) {
			lo := netip.MustParseAddr(ip)
			tcpDial := func(a netip.AddrPort) (net.Conn, error) { return net.DialTimeout("tcp", a.String(), time.Second) }
			udpDial := func(a netip.AddrPort) (net.Conn, error) { return net.Dial("udp", a.String()) }
			for _, b := range []struct {
				name  string
				start func(testing.TB, netip.AddrPort, []string, func(netip.AddrPort) (net.Conn, error))
				ask   func(func(netip.AddrPort) (net.Conn, error), netip.AddrPort, time.Duration) (netip.AddrPort, netip.AddrPort, error)
				dial  func(netip.AddrPort) (net.Conn, error)
				port  uint16
			}{
				{"nginx", StartNginxPeer, AskNginxPeer, tcpDial, freePort(t, "tcp", lo)},
				{"socat", StartSocatPeer, AskSocatPeer, udpDial, freePort(t, "udp", lo)},
			} {
				t.Run(b.name, func(t *testing.T) {
					addr := netip.AddrPortFrom(lo, b.port)
					b.start(t, addr, nil, b.dial)
					for range 3 {
						local, seen, err := b.ask(b.dial, addr, WaitTimeout)
						if err != nil || seen != local {
							t.Fatalf("%s at %s saw %v (%v); want the client's own %v", b.name, addr, seen, err, local)
						}
					}
				})
			}
		})
	}
}

// freePort is a port on ip, of network tcp or udp, that was free a moment ago.
func freePort(t *testing.T, network string, ip netip.Addr) uint16 {
	t.Helper()
	a := netip.AddrPortFrom(ip, 0).String()
	if network == "udp" {
		pc, err := net.ListenPacket("udp", a)
		if err != nil {
			Unavailable(t, "udp on %s: %v", ip, err)
		}
		defer pc.Close()
		return pc.LocalAddr().(*net.UDPAddr).AddrPort().Port()
	}
	ln, err := net.Listen("tcp", a)
	if err != nil {
		Unavailable(t, "tcp on %s: %v", ip, err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).AddrPort().Port()
}
