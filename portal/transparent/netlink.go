package transparent

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/nlhandle"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Netlink is the seam over rtnetlink and /proc/sys/net that the plumbing needs.
type Netlink interface {
	// Rules lists fam's ip rules that match a fwmark.
	Rules(ctx context.Context, fam portal.Family) ([]Rule, error)
	AddRule(ctx context.Context, fam portal.Family, r Rule) error
	DeleteRule(ctx context.Context, fam portal.Family, r Rule) error
	// LocalRoutes lists the destinations of the local routes on lo in table.
	LocalRoutes(ctx context.Context, fam portal.Family, table int) ([]netip.Prefix, error)
	AddLocalRoute(ctx context.Context, fam portal.Family, table int, dst netip.Prefix) error
	DeleteLocalRoute(ctx context.Context, fam portal.Family, table int, dst netip.Prefix) error
	// Bridges lists the node's bridges, each saying whether it has a permanent local fdb entry
	// for mac.
	Bridges(ctx context.Context, mac net.HardwareAddr) ([]Bridge, error)
	// BridgesWithPorts lists the indexes of the node's bridges that have a port (one link
	// dump: cheap enough to ask every second).
	BridgesWithPorts(ctx context.Context) ([]int, error)
	AddFDB(ctx context.Context, bridge int, mac net.HardwareAddr) error
	DeleteFDB(ctx context.Context, bridge int, mac net.HardwareAddr) error
	// Sysctl reads /proc/sys/<name> of the network namespace; a missing file wraps os.ErrNotExist.
	Sysctl(ctx context.Context, name string) (string, error)
}

// Bridge is one bridge device of the node.
type Bridge struct {
	Name   string
	Index  int
	HasMAC bool
	// Ports counts the links enslaved to it (a bridge without ports bridges nothing: bind mode's
	// kube-portal0 where the kernel has no dummy links).
	Ports int
}

// KernelNetlink implements Netlink with github.com/vishvananda/netlink, keeping one handle open
// between calls. The zero value is ready; Close releases the handle.
type KernelNetlink struct {
	// Do, when set, runs each operation, e.g. on a thread switched into another network namespace
	// (tests pass netns.NS.Do: the handle is opened there, and /proc/sys/net is that namespace's).
	Do func(func() error) error

	handle nlhandle.Keeper
}

var _ Netlink = (*KernelNetlink)(nil)

// Close closes the handle, if one is open.
func (k *KernelNetlink) Close() error { return k.handle.Close() }

func (k *KernelNetlink) run(ctx context.Context, fn func(h *netlink.Handle) error) error {
	return k.handle.Run(ctx, k.Do, fn)
}

func nlFamily(fam portal.Family) int {
	if fam == portal.IPv6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

func (r Rule) netlink(fam portal.Family) *netlink.Rule {
	nr := netlink.NewRule()
	nr.Family = nlFamily(fam)
	nr.Priority = r.Priority
	nr.Table = r.Table
	nr.Mark = r.Mark
	mask := r.Mask
	nr.Mask = &mask
	return nr
}

// Rules implements Netlink.
func (k *KernelNetlink) Rules(ctx context.Context, fam portal.Family) ([]Rule, error) {
	var out []Rule
	err := k.run(ctx, func(h *netlink.Handle) error {
		rules, err := h.RuleList(nlFamily(fam))
		if err != nil {
			return err
		}
		for _, r := range rules {
			if r.Mask == nil || *r.Mask == 0 {
				continue
			}
			out = append(out, Rule{Priority: r.Priority, Mark: r.Mark, Mask: *r.Mask, Table: r.Table})
		}
		return nil
	})
	return out, err
}

// AddRule implements Netlink.
func (k *KernelNetlink) AddRule(ctx context.Context, fam portal.Family, r Rule) error {
	return k.run(ctx, func(h *netlink.Handle) error { return h.RuleAdd(r.netlink(fam)) })
}

// DeleteRule implements Netlink.
func (k *KernelNetlink) DeleteRule(ctx context.Context, fam portal.Family, r Rule) error {
	return k.run(ctx, func(h *netlink.Handle) error { return h.RuleDel(r.netlink(fam)) })
}

// loIndex is the loopback's index: 1 in every network namespace.
const loIndex = 1

// LocalRoutes implements Netlink.
func (k *KernelNetlink) LocalRoutes(ctx context.Context, fam portal.Family, table int) ([]netip.Prefix, error) {
	var out []netip.Prefix
	err := k.run(ctx, func(h *netlink.Handle) error {
		routes, err := h.RouteListFiltered(nlFamily(fam), &netlink.Route{Table: table, Type: unix.RTN_LOCAL},
			netlink.RT_FILTER_TABLE|netlink.RT_FILTER_TYPE)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.LinkIndex != loIndex {
				continue
			}
			out = append(out, routeDst(fam, r.Dst))
		}
		return nil
	})
	return out, err
}

// routeDst converts a route's destination; the library gives nil, or 0.0.0.0/0, for a default
// route depending on its version.
func routeDst(fam portal.Family, dst *net.IPNet) netip.Prefix {
	if dst == nil {
		return anyLocal(fam)
	}
	a, _ := netip.AddrFromSlice(dst.IP)
	if fam == portal.IPv4 {
		a = a.Unmap()
	}
	ones, _ := dst.Mask.Size()
	return netip.PrefixFrom(a, ones)
}

func localRoute(fam portal.Family, table int, dst netip.Prefix) *netlink.Route {
	return &netlink.Route{Family: nlFamily(fam), Table: table, Type: unix.RTN_LOCAL, Scope: unix.RT_SCOPE_HOST,
		LinkIndex: loIndex, Dst: &net.IPNet{IP: dst.Addr().AsSlice(), Mask: net.CIDRMask(dst.Bits(), dst.Addr().BitLen())}}
}

// AddLocalRoute implements Netlink.
func (k *KernelNetlink) AddLocalRoute(ctx context.Context, fam portal.Family, table int, dst netip.Prefix) error {
	return k.run(ctx, func(h *netlink.Handle) error { return h.RouteAdd(localRoute(fam, table, dst)) })
}

// DeleteLocalRoute implements Netlink.
func (k *KernelNetlink) DeleteLocalRoute(ctx context.Context, fam portal.Family, table int, dst netip.Prefix) error {
	return k.run(ctx, func(h *netlink.Handle) error { return h.RouteDel(localRoute(fam, table, dst)) })
}

// Bridges implements Netlink.
func (k *KernelNetlink) Bridges(ctx context.Context, mac net.HardwareAddr) ([]Bridge, error) {
	var out []Bridge
	err := k.run(ctx, func(h *netlink.Handle) error {
		links, err := h.LinkList()
		if err != nil {
			return err
		}
		ports := map[int]int{} // bridge index -> links enslaved to it
		for _, l := range links {
			if m := l.Attrs().MasterIndex; m != 0 {
				ports[m]++
			}
		}
		for _, l := range links {
			if l.Type() != "bridge" {
				continue
			}
			br := Bridge{Name: l.Attrs().Name, Index: l.Attrs().Index, Ports: ports[l.Attrs().Index]}
			neighs, err := h.NeighList(br.Index, unix.AF_BRIDGE)
			if err != nil {
				return fmt.Errorf("bridge %s: list fdb: %w", br.Name, err)
			}
			for _, nb := range neighs {
				br.HasMAC = br.HasMAC || bytes.Equal(nb.HardwareAddr, mac) && nb.State&netlink.NUD_PERMANENT != 0
			}
			out = append(out, br)
		}
		return nil
	})
	return out, err
}

// BridgesWithPorts implements Netlink.
func (k *KernelNetlink) BridgesWithPorts(ctx context.Context) ([]int, error) {
	var out []int
	err := k.run(ctx, func(h *netlink.Handle) error {
		links, err := h.LinkList()
		if err != nil {
			return err
		}
		bridges := map[int]bool{}
		for _, l := range links {
			if l.Type() == "bridge" {
				bridges[l.Attrs().Index] = true
			}
		}
		seen := map[int]bool{}
		for _, l := range links {
			if m := l.Attrs().MasterIndex; bridges[m] && !seen[m] {
				seen[m] = true
				out = append(out, m)
			}
		}
		return nil
	})
	slices.Sort(out)
	return out, err
}

func fdbEntry(bridge int, mac net.HardwareAddr) *netlink.Neigh {
	return &netlink.Neigh{LinkIndex: bridge, Family: unix.AF_BRIDGE, State: netlink.NUD_PERMANENT,
		Flags: netlink.NTF_SELF, HardwareAddr: mac}
}

// AddFDB implements Netlink: `bridge fdb add MAC dev BR self local`, an entry of the bridge
// itself, so frames to MAC are passed up to the node.
func (k *KernelNetlink) AddFDB(ctx context.Context, bridge int, mac net.HardwareAddr) error {
	return k.run(ctx, func(h *netlink.Handle) error { return h.NeighSet(fdbEntry(bridge, mac)) })
}

// DeleteFDB implements Netlink.
func (k *KernelNetlink) DeleteFDB(ctx context.Context, bridge int, mac net.HardwareAddr) error {
	return k.run(ctx, func(h *netlink.Handle) error { return h.NeighDel(fdbEntry(bridge, mac)) })
}

// Sysctl implements Netlink; it runs under Do, so it reads the namespace's /proc/sys/net.
func (k *KernelNetlink) Sysctl(ctx context.Context, name string) (string, error) {
	var out string
	err := k.run(ctx, func(*netlink.Handle) error {
		b, err := os.ReadFile(filepath.Join("/proc/sys", name))
		out = string(b)
		return err
	})
	return out, err
}
