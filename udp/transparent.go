package udp

// Transparent source: a session's socket bound to the client's own address and port, so the
// endpoint sees the client, not the node. IP_TRANSPARENT (IPV6_TRANSPARENT) lets the socket bind
// an address that is not the node's; the endpoint's replies, addressed to the client, are brought
// back to the socket by the node's plumbing (package portal/transparent: a mangle rule that marks
// packets of transparent sockets, a routing table that delivers marked packets locally), and
// read from it as from any session socket.

import (
	"errors"
	"net/netip"
	"os"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
)

// errSourceTaken marks a socket that could not take the client's address.
var errSourceTaken = errors.New("transparent source not available")

// dialSource returns the address the session of client to ep binds: the client's when the
// policy says so, else the zero AddrPort (the proxy's own, chosen by connect).
func (p *shard) dialSource(client, ep netip.AddrPort) netip.AddrPort {
	pol := p.cfg.Source
	if pol == nil {
		return netip.AddrPort{}
	}
	ca, epa := client.Addr().Unmap(), ep.Addr().Unmap()
	// A client of the other family cannot be the source of a datagram to the endpoint.
	if ca.Is4() != epa.Is4() || !pol.Transparent(ca, epa) {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(ca, client.Port())
}

// dialFrom opens the session socket to ep from src if valid, else, or if src cannot be taken,
// from the proxy's address; it counts both outcomes.
func (p *shard) dialFrom(ep, src netip.AddrPort) (fd int, transparent bool, err error) {
	fd, err = dialUDP(ep, src)
	if !src.IsValid() {
		return fd, false, err
	}
	if errors.Is(err, errSourceTaken) {
		p.stats.transparentFallbacks.Add(1)
		if p.debug() {
			p.log.WithFields(logrus.Fields{"endpoint": ep, "source": src}).WithError(err).
				Debug("transparent session: the client's address is not available, dialing from the proxy's")
		}
		fd, err = dialUDP(ep, netip.AddrPort{})
		return fd, false, err
	}
	if err == nil {
		p.stats.transparentDials.Add(1)
	}
	return fd, err == nil, err
}

// bindSource prepares fd, a new UDP socket of src's family, to send from src, an address of
// another host: IP_TRANSPARENT (IPV6_TRANSPARENT; it needs CAP_NET_ADMIN) allows the bind, and
// SO_REUSEADDR lets it share the port with another transparent socket of the same client (a
// session of another service port, a session being replaced). The error wraps errSourceTaken.
func bindSource(fd int, src netip.AddrPort) error {
	var err error
	if src.Addr().Is4() {
		err = unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
	} else {
		err = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
	}
	if err != nil {
		return errors.Join(errSourceTaken, os.NewSyscallError("setsockopt IP_TRANSPARENT", err))
	}
	if err = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		return errors.Join(errSourceTaken, os.NewSyscallError("setsockopt SO_REUSEADDR", err))
	}
	if err = unix.Bind(fd, sockopt.ToSockaddr(src)); err != nil {
		return errors.Join(errSourceTaken, os.NewSyscallError("bind "+src.String(), err))
	}
	return nil
}
