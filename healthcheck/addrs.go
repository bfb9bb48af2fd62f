package healthcheck

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"strconv"
)

// errNoNodeAddress says that no local address lies inside --nodeport-addresses, so a health check
// port has nowhere to listen. Addresses can appear later, so the open is retried at the next sync.
var errNoNodeAddress = errors.New("no local address inside --nodeport-addresses")

// listenAddr is one socket of a health check port: a network for net.Listen and a host, the
// invalid Addr meaning every address of that network.
type listenAddr struct {
	network string
	host    netip.Addr
}

func (a listenAddr) address(port uint16) string {
	if !a.host.IsValid() {
		return ":" + strconv.Itoa(int(port))
	}
	return netip.AddrPortFrom(a.host, port).String()
}

// listenAddrs is where a health check port listens, following kube-proxy's --nodeport-addresses:
// no prefix means every address (one dual-stack wildcard socket); a /0 prefix means every address
// of its family; otherwise each local address inside a prefix gets its own socket.
func listenAddrs(prefixes []netip.Prefix, local []netip.Addr) []listenAddr {
	var all4, all6 bool
	for _, p := range prefixes {
		if p.Bits() == 0 {
			all4 = all4 || p.Addr().Is4()
			all6 = all6 || p.Addr().Is6()
		}
	}
	if len(prefixes) == 0 || all4 && all6 {
		return []listenAddr{{network: "tcp"}}
	}
	var out []listenAddr
	if all4 {
		out = append(out, listenAddr{network: "tcp4", host: netip.IPv4Unspecified()})
	}
	if all6 {
		out = append(out, listenAddr{network: "tcp6", host: netip.IPv6Unspecified()})
	}
	var hosts []listenAddr
	for _, a := range local {
		a = a.Unmap()
		// An IPv6 link-local address cannot be bound without its zone, which the interface
		// address list does not carry.
		if !a.IsValid() || a.Is4() && all4 || a.Is6() && all6 || a.Is6() && a.IsLinkLocalUnicast() {
			continue
		}
		if slices.ContainsFunc(prefixes, func(p netip.Prefix) bool { return p.Contains(a) }) {
			hosts = append(hosts, listenAddr{network: "tcp", host: a})
		}
	}
	slices.SortFunc(hosts, func(x, y listenAddr) int { return x.host.Compare(y.host) })
	hosts = slices.CompactFunc(hosts, func(x, y listenAddr) bool { return x.host == y.host })
	return append(out, hosts...)
}

// hostAddrs lists the addresses of every interface of the network namespace the process runs in.
func hostAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out, nil
}
