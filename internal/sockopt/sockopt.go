// Package sockopt holds the socket options the TCP and UDP proxy sockets share.
package sockopt

import (
	"net/netip"
	"os"
	"time"

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

// SetKeepAlive turns TCP keepalive on with idle time and probe interval d (whole seconds, at least
// one). Set on a listening socket, it is inherited by every accepted socket.
func SetKeepAlive(fd int, d time.Duration) error {
	secs := max(int(d/time.Second), 1)
	for _, o := range []struct {
		level, opt, v int
		name          string
	}{
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1, "SO_KEEPALIVE"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, secs, "TCP_KEEPIDLE"},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, secs, "TCP_KEEPINTVL"},
	} {
		if err := unix.SetsockoptInt(fd, o.level, o.opt, o.v); err != nil {
			return os.NewSyscallError("setsockopt "+o.name, err)
		}
	}
	return nil
}
