package udp

import (
	"net/netip"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Replies must leave from the address the client's datagram was delivered to: conntrack un-NATs a
// reply to the service address only if its source matches the portal's NAT target. A socket bound
// to a wildcard address would otherwise let routing pick the source (the legacy proxy's "replies
// come from the eth0 IP" problem, which forced it to DNAT host traffic to the node IP). So the
// listening socket asks for IP_PKTINFO / IPV6_PKTINFO on every datagram, each session remembers
// its local address, and every reply carries it as the source in a control message.

// control is a control-message buffer, uint64 words so that the cmsghdr in it is aligned.
type control [8]uint64

const controlLen = int(unsafe.Sizeof(control{}))

func enablePktinfo(fd int, fam int) error {
	if fam == unix.AF_INET {
		return os.NewSyscallError("setsockopt IP_PKTINFO", unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_PKTINFO, 1))
	}
	return os.NewSyscallError("setsockopt IPV6_RECVPKTINFO",
		unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1))
}

// localAddr returns the local address a datagram was delivered to, from its first control message
// (the only one the listening socket asks for).
func localAddr(c *control, n int) (netip.Addr, bool) {
	if n < unix.SizeofCmsghdr {
		return netip.Addr{}, false
	}
	h := (*unix.Cmsghdr)(unsafe.Pointer(c))
	data := unsafe.Add(unsafe.Pointer(c), unix.CmsgLen(0))
	switch {
	case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_PKTINFO && int(h.Len) >= unix.CmsgLen(unix.SizeofInet4Pktinfo):
		// Spec_dst, not Addr: for a broadcast it is the local address, usable as a source.
		return netip.AddrFrom4((*unix.Inet4Pktinfo)(data).Spec_dst), true
	case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_PKTINFO && int(h.Len) >= unix.CmsgLen(unix.SizeofInet6Pktinfo):
		return netip.AddrFrom16((*unix.Inet6Pktinfo)(data).Addr), true
	}
	return netip.Addr{}, false
}

// sourceControl builds the control message that sends a datagram from local. It returns the
// length to use, 0 when local is invalid (the kernel then chooses).
func sourceControl(c *control, local netip.Addr) int {
	*c = control{}
	if !local.IsValid() {
		return 0
	}
	h := (*unix.Cmsghdr)(unsafe.Pointer(c))
	data := unsafe.Add(unsafe.Pointer(c), unix.CmsgLen(0))
	if local.Is4() {
		h.Level, h.Type = unix.IPPROTO_IP, unix.IP_PKTINFO
		h.SetLen(unix.CmsgLen(unix.SizeofInet4Pktinfo))
		(*unix.Inet4Pktinfo)(data).Spec_dst = local.As4()
		return unix.CmsgSpace(unix.SizeofInet4Pktinfo)
	}
	h.Level, h.Type = unix.IPPROTO_IPV6, unix.IPV6_PKTINFO
	h.SetLen(unix.CmsgLen(unix.SizeofInet6Pktinfo))
	(*unix.Inet6Pktinfo)(data).Addr = local.As16()
	return unix.CmsgSpace(unix.SizeofInet6Pktinfo)
}
