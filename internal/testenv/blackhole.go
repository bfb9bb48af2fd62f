package testenv

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// UnansweredTCP returns an endpoint on the loopback address ip that drops SYNs: a listener with a
// backlog of 0 whose accept queue is full with one connection nobody accepts, so a connect to it
// stays in SYN_SENT until the dial's deadline (the kernel retransmits the SYN only after a
// second). Everything is closed when t ends.
func UnansweredTCP(t testing.TB, ip netip.Addr) netip.AddrPort {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socket: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: ip.As4()}); err != nil {
		t.Fatalf("bind %s: %v", ip, err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatalf("listen: %v", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatalf("getsockname: %v", err)
	}
	in4 := sa.(*unix.SockaddrInet4)
	ap := netip.AddrPortFrom(netip.AddrFrom4(in4.Addr), uint16(in4.Port))
	filler, err := net.DialTimeout("tcp4", ap.String(), 5*time.Second)
	if err != nil {
		t.Fatalf("fill the accept queue: %v", err)
	}
	t.Cleanup(func() { filler.Close() })
	return ap
}
