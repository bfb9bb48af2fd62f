package bind

import (
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

func TestAddrOfSetsNodadForIPv6(t *testing.T) {
	for _, s := range []string{"10.96.0.10/32", "fd00:96::10/128", "192.168.7.1/24"} {
		p := netip.MustParsePrefix(s)
		a := addrOf(p)
		if got, _ := netip.AddrFromSlice(a.IP); got.Unmap() != p.Addr() {
			t.Errorf("addrOf(%s) address = %v", p, a.IP)
		}
		if ones, _ := a.Mask.Size(); ones != p.Bits() {
			t.Errorf("addrOf(%s) prefix length = %d", p, ones)
		}
		if want := p.Addr().Is6(); (a.Flags&unix.IFA_F_NODAD != 0) != want {
			t.Errorf("addrOf(%s) nodad = %v, want %v", p, a.Flags&unix.IFA_F_NODAD != 0, want)
		}
	}
}

// TestAddrOfLinkReadsDumpMessages checks the parsing of RTM_NEWADDR payloads as the kernel sends
// them in an address dump: only the link's, IFA_LOCAL before IFA_ADDRESS, malformed ones skipped.
func TestAddrOfLinkReadsDumpMessages(t *testing.T) {
	const link = 7
	msg := func(family, bits uint8, index uint32, attrs ...*nl.RtAttr) []byte {
		m := nl.NewIfAddrmsg(int(family))
		m.Prefixlen, m.Index = bits, index
		b := m.Serialize()
		for _, a := range attrs {
			b = append(b, a.Serialize()...)
		}
		return b
	}
	ip := func(s string) []byte { return netip.MustParseAddr(s).AsSlice() }
	tests := []struct {
		name string
		m    []byte
		want string // "" for not taken
	}{
		{"ipv4 on the link", msg(unix.AF_INET, 32, link, nl.NewRtAttr(unix.IFA_ADDRESS, ip("10.96.0.10")), nl.NewRtAttr(unix.IFA_LOCAL, ip("10.96.0.10"))), "10.96.0.10/32"},
		{"ipv6 on the link (no IFA_LOCAL)", msg(unix.AF_INET6, 128, link, nl.NewRtAttr(unix.IFA_ADDRESS, ip("fd00:96::10"))), "fd00:96::10/128"},
		{"point-to-point: the local address, not the peer", msg(unix.AF_INET, 24, link, nl.NewRtAttr(unix.IFA_ADDRESS, ip("192.168.7.2")), nl.NewRtAttr(unix.IFA_LOCAL, ip("192.168.7.1"))), "192.168.7.1/24"},
		{"label and other attributes skipped", msg(unix.AF_INET, 32, link, nl.NewRtAttr(unix.IFA_LABEL, []byte("kube-portal0\x00")), nl.NewRtAttr(unix.IFA_LOCAL, ip("10.96.0.11"))), "10.96.0.11/32"},
		{"another link", msg(unix.AF_INET, 32, link+1, nl.NewRtAttr(unix.IFA_LOCAL, ip("10.96.0.10"))), ""},
		{"no address attribute", msg(unix.AF_INET, 32, link), ""},
		{"prefix longer than the address", msg(unix.AF_INET, 33, link, nl.NewRtAttr(unix.IFA_LOCAL, ip("10.96.0.10"))), ""},
		{"truncated header", msg(unix.AF_INET, 32, link)[:4], ""},
		{"attribute length past the end", append(msg(unix.AF_INET, 32, link), 40, 0, 2, 0, 10, 96), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := addrOfLink(tt.m, link)
			if tt.want == "" {
				if ok {
					t.Fatalf("took %v, want nothing", got)
				}
				return
			}
			if !ok || got != netip.MustParsePrefix(tt.want) {
				t.Fatalf("got %v, %v; want %s", got, ok, tt.want)
			}
		})
	}
}
