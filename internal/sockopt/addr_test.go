package sockopt

import (
	"net/netip"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestPortByteOrder(t *testing.T) {
	raw := Htons(0x1234)
	b := (*[2]byte)(unsafe.Pointer(&raw))
	if b[0] != 0x12 || b[1] != 0x34 {
		t.Fatalf("Htons(0x1234) is stored as % x, want 12 34", b[:])
	}
	if got := Ntohs(raw); got != 0x1234 {
		t.Fatalf("Ntohs(Htons(0x1234)) = %#x", got)
	}
}

func TestParseRaw(t *testing.T) {
	for _, want := range []netip.AddrPort{
		netip.MustParseAddrPort("10.96.0.10:53"),
		netip.MustParseAddrPort("[fd00::10]:8080"),
	} {
		var rsa unix.RawSockaddrInet6
		if want.Addr().Is4() {
			sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(&rsa))
			sa4.Family, sa4.Port, sa4.Addr = unix.AF_INET, Htons(want.Port()), want.Addr().As4()
		} else {
			rsa.Family, rsa.Port, rsa.Addr = unix.AF_INET6, Htons(want.Port()), want.Addr().As16()
		}
		got, ok := ParseRaw(&rsa)
		if !ok || got != want {
			t.Errorf("ParseRaw = %v, %v; want %v", got, ok, want)
		}
		if back := FromSockaddr(ToSockaddr(want)); back != want {
			t.Errorf("FromSockaddr(ToSockaddr(%v)) = %v", want, back)
		}
	}
	// A v4-mapped address is IPv4 throughout.
	mapped := netip.AddrPortFrom(netip.MustParseAddr("::ffff:127.0.0.1"), 80)
	if Family(mapped.Addr()) != unix.AF_INET {
		t.Errorf("Family(%v) is not AF_INET", mapped.Addr())
	}
	if back := FromSockaddr(ToSockaddr(mapped)); back != netip.MustParseAddrPort("127.0.0.1:80") {
		t.Errorf("a v4-mapped address round-trips to %v", back)
	}
	var unknown unix.RawSockaddrInet6
	unknown.Family = unix.AF_UNIX
	if _, ok := ParseRaw(&unknown); ok {
		t.Error("ParseRaw accepted an AF_UNIX address")
	}
}
