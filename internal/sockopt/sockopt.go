// Package sockopt holds the socket options and address conversions the TCP and UDP proxy sockets
// share.
package sockopt

import (
	"net/netip"
	"os"

	"golang.org/x/sys/unix"
)

// SetFreeBind lets a socket bind to an address that is not (yet) local: in bind portal mode the
// sockets open before the service IPs are put on the portal interface.
func SetFreeBind(fd int, a netip.Addr) error {
	if a.Is4() || a.Is4In6() {
		return os.NewSyscallError("setsockopt IP_FREEBIND", unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_FREEBIND, 1))
	}
	return os.NewSyscallError("setsockopt IPV6_FREEBIND", unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_FREEBIND, 1))
}
