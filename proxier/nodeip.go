package proxier

import (
	"bufio"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// NodeIPSources are where node IPs can come from, in order of preference.
type NodeIPSources struct {
	// Bind is --bind-address; a specific address is the node IP of its family.
	Bind netip.Addr
	// NodeAddresses are the Node object's InternalIP then ExternalIP addresses (--hostname-override).
	NodeAddresses []netip.Addr
	// DefaultRouteIfaces names the interfaces holding the default route per family.
	DefaultRouteIfaces map[portal.Family]string
	// InterfaceAddrs lists every interface's addresses by interface name.
	InterfaceAddrs map[string][]netip.Addr
	// Exclude names interfaces whose addresses are never node IPs: bind mode's portal interface
	// carries service IPs (still there after a restart, before the first sync).
	Exclude []string
}

// NodeIPs picks one node IP per family: the bind address, else the Node object's address, else a
// global unicast address of the default-route interface, else of any interface (sorted by name).
func NodeIPs(src NodeIPSources) map[portal.Family]netip.Addr {
	out := map[portal.Family]netip.Addr{}
	take := func(a netip.Addr) {
		a = a.Unmap()
		if !a.IsValid() || a.IsUnspecified() || a.IsLoopback() || a.IsLinkLocalUnicast() {
			return
		}
		if _, ok := out[portal.FamilyOf(a)]; !ok {
			out[portal.FamilyOf(a)] = a
		}
	}
	take(src.Bind)
	for _, a := range src.NodeAddresses {
		take(a)
	}
	for _, fam := range portal.Families {
		if name, ok := src.DefaultRouteIfaces[fam]; ok && !slices.Contains(src.Exclude, name) {
			for _, a := range src.InterfaceAddrs[name] {
				if portal.FamilyOf(a) == fam {
					take(a)
				}
			}
		}
	}
	names := make([]string, 0, len(src.InterfaceAddrs))
	for n := range src.InterfaceAddrs {
		if !slices.Contains(src.Exclude, n) {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	for _, n := range names {
		for _, a := range src.InterfaceAddrs[n] {
			take(a)
		}
	}
	return out
}

// HostNodeIPSources reads the default-route interfaces and interface addresses of this host (the
// network namespace the process runs in).
func HostNodeIPSources(bind netip.Addr, nodeAddrs []netip.Addr, exclude ...string) NodeIPSources {
	src := NodeIPSources{Bind: bind, NodeAddresses: nodeAddrs, DefaultRouteIfaces: map[portal.Family]string{},
		InterfaceAddrs: map[string][]netip.Addr{}, Exclude: exclude}
	if f, err := os.Open("/proc/net/route"); err == nil {
		if dev := defaultRouteV4(f); dev != "" {
			src.DefaultRouteIfaces[portal.IPv4] = dev
		}
		f.Close()
	}
	if f, err := os.Open("/proc/net/ipv6_route"); err == nil {
		if dev := defaultRouteV6(f); dev != "" {
			src.DefaultRouteIfaces[portal.IPv6] = dev
		}
		f.Close()
	}
	ifaces, _ := net.Interfaces()
	for _, ifc := range ifaces {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 || slices.Contains(exclude, ifc.Name) {
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				src.InterfaceAddrs[ifc.Name] = append(src.InterfaceAddrs[ifc.Name], p.Addr())
			}
		}
	}
	return src
}

// defaultRouteV4 finds the interface of the 0.0.0.0/0 route in /proc/net/route.
func defaultRouteV4(r io.Reader) string {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 7 && f[1] == "00000000" && f[7] == "00000000" {
			return f[0]
		}
	}
	return ""
}

// defaultRouteV6 finds the interface of the ::/0 route in /proc/net/ipv6_route.
func defaultRouteV6(r io.Reader) string {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 10 && f[0] == strings.Repeat("0", 32) && f[1] == "00" && f[9] != "lo" {
			return f[9]
		}
	}
	return ""
}
