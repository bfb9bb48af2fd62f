// Package handover passes a running proxy's listening sockets to the process that replaces it,
// over a Unix socket in a host path (SCM_RIGHTS, as HAProxy passes its listeners on reload). The
// kernel's accept queues and datagram queues are never without an owner during a planned restart,
// so no client is refused: both processes hold the same sockets until the new one is ready, then
// the old one stops accepting and finishes what it has. See README.md for the protocol.
package handover

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// Family is how a socket listens: in one family, or (dual) an IPv6 wildcard socket that also
// takes IPv4, as package net opens for "tcp" or "udp" on an unspecified address.
type Family string

const (
	IPv4 Family = "ipv4"
	IPv6 Family = "ipv6"
	Dual Family = "dual"
)

// Entry describes one handed-over descriptor in the manifest.
type Entry struct {
	// Name is for logs: protocol/address:port.
	Name     string `json:"name"`
	Protocol string `json:"protocol"` // "tcp" (listening) or "udp" (bound, unconnected)
	Family   Family `json:"family"`
	Address  string `json:"address"`
	Port     uint16 `json:"port"`
}

// key is what a taker asks for: the same protocol, family and address the old socket had.
type key struct {
	proto  string
	family Family
	addr   netip.Addr
	port   uint16
}

func (e Entry) key() (key, error) {
	a, err := netip.ParseAddr(e.Address)
	if err != nil {
		return key{}, fmt.Errorf("handover: manifest entry %.100q: address: %w", e.Name, err)
	}
	return key{proto: e.Protocol, family: e.Family, addr: a, port: e.Port}, nil
}

// check returns the key of a received descriptor, after checking that it is what the entry says:
// a listening TCP or bound UDP socket of that family, address and port. The sockets are used
// wherever this process would bind, so a descriptor that is something else (a connected socket, a
// file, a socket on another port) must not be taken for the one the entry names.
func (e Entry) check(fd int) (key, error) {
	k, err := e.key()
	if err != nil {
		return key{}, err
	}
	got, ok := classify(fd)
	if !ok {
		return key{}, fmt.Errorf("handover: manifest entry %.100q: the descriptor is not a listening socket", e.Name)
	}
	if gk, _ := got.key(); gk != k {
		return key{}, fmt.Errorf("handover: manifest entry %.100q: the descriptor is %s (%s)", e.Name, got.Name, got.Family)
	}
	return k, nil
}

func newEntry(proto string, family Family, ap netip.AddrPort) Entry {
	return Entry{Name: proto + "/" + ap.String(), Protocol: proto, Family: family, Address: ap.Addr().String(), Port: ap.Port()}
}

// socket is a descriptor together with what it is: fd, when not -1, is a duplicate the sender
// owns and closes once sent; otherwise it is duplicated from src, this process's own
// descriptor of the socket (inode ino), only as its chunk is sent (take).
type socket struct {
	Entry
	fd  int
	src int
	ino uint64
}

// Collect lists every listening socket of this process: TCP sockets in the listening state and
// bound, unconnected UDP sockets (the proxy sockets, the held node ports, the health check node
// ports, the health and metrics listeners). A socket with several descriptors is listed once.
// Connected sockets (proxied connections, UDP sessions' upstream sockets) and other kinds
// (netlink, Unix) are left out.
//
// Each is looked at through a duplicate, closed at once: the sockets are duplicated again one
// chunk at a time as they are sent (take), so the process never holds a duplicate of each. It
// did: at 10,000 service ports under a 20,000 open-file limit the duplicates of the last sockets
// failed with EMFILE and those sockets were silently left out (the successor found their ports
// in use and moved them), and the proxy's accepts failed with EMFILE until the sockets were sent.
func Collect() ([]socket, error) {
	dir, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, fmt.Errorf("handover: list descriptors: %w", err)
	}
	var out []socket
	seen := map[uint64]bool{} // socket inodes
	for _, d := range dir {
		n, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		dup, err := unix.FcntlInt(uintptr(n), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			continue // closed since the directory was read (or the directory's own descriptor)
		}
		var st unix.Stat_t
		if e, ok := classify(dup); ok && unix.Fstat(dup, &st) == nil && !seen[st.Ino] {
			seen[st.Ino] = true
			out = append(out, socket{Entry: e, fd: -1, src: n, ino: st.Ino})
		}
		unix.Close(dup)
	}
	return out, nil
}

// take makes sure sk holds a duplicate to send: a descriptor another goroutine closed since
// Collect (its number maybe reused by another file) is an error, not a wrong socket sent under
// the entry's name.
func (sk *socket) take() error {
	if sk.fd >= 0 {
		return nil
	}
	dup, err := unix.FcntlInt(uintptr(sk.src), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("handover: duplicate %s (descriptor %d): %w", sk.Name, sk.src, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(dup, &st); err != nil || st.Ino != sk.ino {
		unix.Close(dup)
		return fmt.Errorf("handover: %s (descriptor %d) was closed during the hand-over", sk.Name, sk.src)
	}
	sk.fd = dup
	return nil
}

// classify says what fd is, and whether it is a socket to hand over.
func classify(fd int) (Entry, bool) {
	domain, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil || (domain != unix.AF_INET && domain != unix.AF_INET6) {
		return Entry{}, false
	}
	typ, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	var proto string
	switch typ {
	case unix.SOCK_STREAM:
		if on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || on == 0 {
			return Entry{}, false
		}
		proto = "tcp"
	case unix.SOCK_DGRAM:
		if p, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL); p != unix.IPPROTO_UDP {
			return Entry{}, false
		}
		if _, err := unix.Getpeername(fd); !errors.Is(err, unix.ENOTCONN) {
			return Entry{}, false // a session's connected upstream socket
		}
		proto = "udp"
	default:
		return Entry{}, false
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return Entry{}, false
	}
	ap := sockopt.FromSockaddr(sa)
	if ap.Port() == 0 {
		return Entry{}, false
	}
	family := IPv4
	if domain == unix.AF_INET6 {
		family = IPv6
		if v6only, _ := unix.GetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY); v6only == 0 && ap.Addr().IsUnspecified() {
			family = Dual
		}
	}
	return newEntry(proto, family, ap), true
}

// wildcardKeys are the sockets that could serve a package-net style listen on an unspecified
// address ("tcp", ":10256" or "0.0.0.0:10256"): package net opens an IPv6 socket that also takes
// IPv4 where the node has IPv6, an IPv4 one where it has not.
func wildcardKeys(proto string, port uint16) []key {
	return []key{
		{proto: proto, family: Dual, addr: netip.IPv6Unspecified(), port: port},
		{proto: proto, family: IPv4, addr: netip.IPv4Unspecified(), port: port},
	}
}

// exactKey is the socket a proxy opens itself on ap: one family, IPV6_V6ONLY for IPv6.
func exactKey(proto string, ap netip.AddrPort) key {
	family := IPv4
	if ap.Addr().Is6() && !ap.Addr().Is4In6() {
		family = IPv6
	}
	return key{proto: proto, family: family, addr: ap.Addr().Unmap(), port: ap.Port()}
}

// netKeys are the candidates for a package-net style listen on network ("tcp", "tcp4", "udp6",
// ...) and address ("host:port").
func netKeys(network, address string) ([]key, error) {
	host, portStr, err := net.SplitHostPort(address)
	if err != nil {
		return nil, err
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("port %q: %w", portStr, err)
	}
	proto := network[:3]
	var ip netip.Addr
	if host != "" {
		if ip, err = netip.ParseAddr(host); err != nil {
			return nil, err
		}
	}
	v := network[len(network)-1]
	switch {
	case v == '4' && (!ip.IsValid() || ip.IsUnspecified()):
		return []key{exactKey(proto, netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(port)))}, nil
	case v == '6' && (!ip.IsValid() || ip.IsUnspecified()):
		return []key{exactKey(proto, netip.AddrPortFrom(netip.IPv6Unspecified(), uint16(port)))}, nil
	case !ip.IsValid() || ip.IsUnspecified():
		return wildcardKeys(proto, uint16(port)), nil
	}
	return []key{exactKey(proto, netip.AddrPortFrom(ip, uint16(port)))}, nil
}
