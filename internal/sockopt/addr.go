package sockopt

import (
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Address conversions shared by the TCP and UDP proxy sockets. IPv4-mapped IPv6 addresses are
// treated as IPv4 throughout.

// Family is the socket address family for a.
func Family(a netip.Addr) int {
	if a.Unmap().Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// ToSockaddr converts ap for bind or connect.
func ToSockaddr(ap netip.AddrPort) unix.Sockaddr {
	a := ap.Addr().Unmap()
	if a.Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: a.As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: a.As16()}
}

// FromSockaddr converts an address from getsockname and the like.
func FromSockaddr(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), uint16(sa.Port))
	}
	return netip.AddrPort{}
}

// ParseRaw decodes a raw address as the kernel fills it in (recvmmsg, accept4); false for a family
// other than IPv4 and IPv6. RawSockaddrInet6 is big enough for both.
func ParseRaw(rsa *unix.RawSockaddrInet6) (netip.AddrPort, bool) {
	switch rsa.Family {
	case unix.AF_INET:
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(rsa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), Ntohs(sa4.Port)), true
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16(rsa.Addr).Unmap(), Ntohs(rsa.Port)), true
	}
	return netip.AddrPort{}, false
}

// Htons and Ntohs convert between a port and its network byte order form in a raw sockaddr.
func Htons(port uint16) uint16 {
	var raw uint16
	b := (*[2]byte)(unsafe.Pointer(&raw))
	b[0], b[1] = byte(port>>8), byte(port)
	return raw
}

// Ntohs: see Htons.
func Ntohs(raw uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&raw))
	return uint16(b[0])<<8 | uint16(b[1])
}

// SockName is getsockname(2) without package unix's allocation of a Sockaddr (the flow stream
// reads it per flow); the zero AddrPort on an error.
func SockName(fd int) netip.AddrPort {
	var rsa unix.RawSockaddrInet6 // the larger of the two families
	n := uint32(unsafe.Sizeof(rsa))
	_, _, e := unix.RawSyscall(unix.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&rsa)), uintptr(unsafe.Pointer(&n)))
	if e != 0 {
		return netip.AddrPort{}
	}
	a, _ := ParseRaw(&rsa)
	return a
}
