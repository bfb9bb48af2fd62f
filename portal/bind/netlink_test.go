package bind

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

func TestIsLocalRoute6(t *testing.T) {
	a := netip.MustParseAddr("fd00:96::10")
	route := func(typ, bits uint8, dst netip.Addr) []byte {
		m := &nl.RtMsg{RtMsg: unix.RtMsg{Family: unix.AF_INET6, Dst_len: bits, Type: typ}}
		return append(m.Serialize(), nl.NewRtAttr(unix.RTA_DST, dst.AsSlice()).Serialize()...)
	}
	tests := []struct {
		name string
		data []byte
		want bool
	}{
		{"local_route_of_the_address", route(unix.RTN_LOCAL, 128, a), true},
		{"prefix_route_of_the_address", route(unix.RTN_UNICAST, 128, a), false},
		{"local_route_of_another_address", route(unix.RTN_LOCAL, 128, netip.MustParseAddr("fd00:96::11")), false},
		{"local_prefix", route(unix.RTN_LOCAL, 64, a), false},
		{"truncated", route(unix.RTN_LOCAL, 128, a)[:4], false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := isLocalRoute6(tt.data, a); got != tt.want {
				t.Errorf("isLocalRoute6 = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestAddrOfAndPrefixOfRoundTrip(t *testing.T) {
	for _, s := range []string{"10.96.0.10/32", "fd00:96::10/128", "192.168.7.1/24"} {
		p := netip.MustParsePrefix(s)
		a := addrOf(p)
		got, ok := prefixOf(a.IPNet)
		if !ok || got != p {
			t.Errorf("prefixOf(addrOf(%s)) = %v, %v", p, got, ok)
		}
		if want := p.Addr().Is6(); (a.Flags&unix.IFA_F_NODAD != 0) != want {
			t.Errorf("addrOf(%s) nodad = %v, want %v", p, a.Flags&unix.IFA_F_NODAD != 0, want)
		}
	}
	if _, ok := prefixOf(&net.IPNet{IP: net.IP{1, 2}}); ok {
		t.Error("prefixOf accepted a 2-byte IP")
	}
}
