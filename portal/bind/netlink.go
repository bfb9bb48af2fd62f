package bind

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/nlhandle"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

const (
	// dumpRetries bounds how often an address dump that a concurrent change interrupted is
	// repeated.
	dumpRetries = 5
	// localRouteWait bounds how long an IPv6 address add waits for the address's local route.
	localRouteWait = 2 * time.Second
)

// Netlink is the LinkManager of the node: rtnetlink requests through
// github.com/vishvananda/netlink (the library kube-proxy uses) for links and addresses, and files
// under /proc/sys for sysctls. It keeps one netlink handle open between operations (opening a
// socket costs more than a request); Close releases it. Safe for concurrent use; the zero value is
// ready.
type Netlink struct {
	// Do, when set, runs each operation, e.g. on a thread switched into another network namespace
	// (tests pass netns.NS.Do: the handle, opened inside, stays in that namespace, and /proc/sys/net
	// is that of the calling thread's namespace). Nil runs it on the calling goroutine.
	Do func(func() error) error

	handle nlhandle.Keeper // the one handle, and the lock of every operation
	// dumped is how many addresses the last dump listed, to size the next one's slice.
	dumped int
}

// Close closes the handle, if one is open. The next operation opens a new one.
func (n *Netlink) Close() error { return n.handle.Close() }

// run runs fn with the shared handle (nlhandle.Keeper).
func (n *Netlink) run(ctx context.Context, fn func(h *netlink.Handle) error) error {
	return n.handle.Run(ctx, n.Do, fn)
}

func (n *Netlink) runPlain(fn func() error) error {
	if n.Do != nil {
		return n.Do(fn)
	}
	return fn()
}

// linkByName returns the link, or an error wrapping ErrLinkNotFound.
func linkByName(h *netlink.Handle, name string) (netlink.Link, error) {
	l, err := h.LinkByName(name)
	if _, ok := errors.AsType[netlink.LinkNotFoundError](err); ok || errors.Is(err, unix.ENODEV) {
		return nil, fmt.Errorf("link %s: %w", name, ErrLinkNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("link %s: %w", name, err)
	}
	return l, nil
}

// kindOf is the IFLA_INFO_KIND of l; "" for a plain device (the library calls it "device").
func kindOf(l netlink.Link) string {
	if _, ok := l.(*netlink.Device); ok {
		return ""
	}
	return l.Type()
}

// LinkKind implements LinkManager.
func (n *Netlink) LinkKind(ctx context.Context, name string) (string, error) {
	var kind string
	err := n.run(ctx, func(h *netlink.Handle) error {
		l, err := linkByName(h, name)
		if err == nil {
			kind = kindOf(l)
		}
		return err
	})
	return kind, err
}

// newLink is the link to create for kind.
func newLink(name, kind string) netlink.Link {
	attrs := netlink.LinkAttrs{Name: name, Flags: net.FlagUp}
	switch kind {
	case LinkTypeDummy:
		return &netlink.Dummy{LinkAttrs: attrs}
	case LinkTypeBridge:
		return &netlink.Bridge{LinkAttrs: attrs}
	default:
		return &netlink.GenericLink{LinkAttrs: attrs, LinkType: kind}
	}
}

// EnsureLink implements LinkManager.
func (n *Netlink) EnsureLink(ctx context.Context, name, kind string) error {
	return n.run(ctx, func(h *netlink.Handle) error {
		l, err := linkByName(h, name)
		if errors.Is(err, ErrLinkNotFound) {
			if err := h.LinkAdd(newLink(name, kind)); errors.Is(err, unix.EOPNOTSUPP) {
				return fmt.Errorf("link %s: %w: %s: %w", name, ErrKindUnsupported, kind, err)
			} else if err != nil {
				return fmt.Errorf("link %s: add %s: %w", name, kind, err)
			}
			l, err = linkByName(h, name)
		}
		if err != nil {
			return err
		}
		if k := kindOf(l); k != kind {
			return fmt.Errorf("link %s: exists with kind %q, not %q", name, k, kind)
		}
		if l.Attrs().Flags&net.FlagUp == 0 {
			if err := h.LinkSetUp(l); err != nil {
				return fmt.Errorf("link %s: set up: %w", name, err)
			}
		}
		return nil
	})
}

// DeleteLink implements LinkManager.
func (n *Netlink) DeleteLink(ctx context.Context, name string) error {
	return n.run(ctx, func(h *netlink.Handle) error {
		l, err := linkByName(h, name)
		if err != nil {
			return err
		}
		if err := h.LinkDel(l); errors.Is(err, unix.ENODEV) {
			return fmt.Errorf("link %s: %w", name, ErrLinkNotFound)
		} else if err != nil {
			return fmt.Errorf("link %s: delete: %w", name, err)
		}
		return nil
	})
}

// Addrs implements LinkManager. The kernel can only dump every address of the namespace; the
// dump is read here with the least parsing that serves (index, prefix length and address of each
// message, nothing allocated for another link's): the library's AddrList builds a full
// netlink.Addr of every address before filtering by link, which made an unchanged Sync at 10,000
// service addresses 30% slower, with 8 times the allocations. A dump that a concurrent change made
// inconsistent is repeated.
func (n *Netlink) Addrs(ctx context.Context, name string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	err := n.run(ctx, func(h *netlink.Handle) error {
		l, err := linkByName(h, name)
		if err != nil {
			return err
		}
		for range dumpRetries {
			out, err = dumpAddrs(l.Attrs().Index, n.dumped)
			if !errors.Is(err, netlink.ErrDumpInterrupted) {
				break
			}
		}
		if err != nil {
			return fmt.Errorf("link %s: list addresses: %w", name, err)
		}
		n.dumped = len(out)
		return nil
	})
	return out, err
}

// dumpAddrs lists the addresses of the link with index idx, from one RTM_GETADDR dump on a socket
// of the calling thread's namespace (the handle's: both are opened by the thread run uses).
func dumpAddrs(idx, sizeHint int) ([]netip.Prefix, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETADDR, unix.NLM_F_DUMP)
	req.AddData(nl.NewIfAddrmsg(unix.AF_UNSPEC))
	out := make([]netip.Prefix, 0, sizeHint)
	err := req.ExecuteIter(unix.NETLINK_ROUTE, unix.RTM_NEWADDR, func(m []byte) bool {
		if p, ok := addrOfLink(m, idx); ok {
			out = append(out, p)
		}
		return true
	})
	return out, err
}

// addrOfLink reads one RTM_NEWADDR payload: the address (IFA_LOCAL when present: on a
// point-to-point link IFA_ADDRESS is the peer) and prefix length, when it is of link idx.
func addrOfLink(m []byte, idx int) (netip.Prefix, bool) {
	if len(m) < unix.SizeofIfAddrmsg {
		return netip.Prefix{}, false
	}
	hdr := nl.DeserializeIfAddrmsg(m)
	if int(hdr.Index) != idx {
		return netip.Prefix{}, false
	}
	var local, address []byte
	native := nl.NativeEndian()
	for attrs := m[unix.SizeofIfAddrmsg:]; len(attrs) >= unix.SizeofRtAttr; {
		l := int(native.Uint16(attrs[0:2]))
		if l < unix.SizeofRtAttr || l > len(attrs) {
			break
		}
		switch native.Uint16(attrs[2:4]) {
		case unix.IFA_LOCAL:
			local = attrs[unix.SizeofRtAttr:l]
		case unix.IFA_ADDRESS:
			address = attrs[unix.SizeofRtAttr:l]
		}
		attrs = attrs[min((l+unix.RTA_ALIGNTO-1)&^(unix.RTA_ALIGNTO-1), len(attrs)):]
	}
	if local == nil {
		local = address
	}
	a, ok := netip.AddrFromSlice(local)
	if !ok || int(hdr.Prefixlen) > a.BitLen() {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, int(hdr.Prefixlen)), true
}

// addrOf is the library's form of p. IPv6 addresses skip duplicate address detection: a
// tentative address is not local yet (no local route, bind fails without IP_FREEBIND), and on a
// link without carrier, like a bridge without ports, it would stay tentative for good.
func addrOf(p netip.Prefix) *netlink.Addr {
	a := p.Addr().Unmap()
	bits := 32
	if a.Is6() {
		bits = 128
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(p.Bits(), bits)}}
	if a.Is6() {
		addr.Flags = unix.IFA_F_NODAD
	}
	return addr
}

// AddAddr implements LinkManager.
func (n *Netlink) AddAddr(ctx context.Context, name string, addr netip.Prefix) error {
	return n.run(ctx, func(h *netlink.Handle) error {
		l, err := linkByName(h, name)
		if err != nil {
			return err
		}
		if addr.Addr().Unmap().Is6() {
			err = addAddr6(h, l, addr)
		} else {
			err = h.AddrAdd(l, addrOf(addr))
		}
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("link %s: add address %s: %w", name, addr, err)
		}
		return nil
	})
}

// addAddr6 adds an IPv6 address and returns once the kernel routes it locally. The kernel inserts
// an IPv6 address's local route from a work item after it acks RTM_NEWADDR (even with nodad);
// until then the address's /128 prefix route in the main table sends its packets into the link,
// and a TCP socket that connects in that window caches that route and never gets through. So a
// socket subscribed to IPv6 route notifications before the add waits for that local route. The
// subscription is opened on the calling thread, so it is in the same namespace as the handle.
func addAddr6(h *netlink.Handle, l netlink.Link, p netip.Prefix) error {
	s, err := nl.Subscribe(unix.NETLINK_ROUTE, unix.RTNLGRP_IPV6_ROUTE)
	if err != nil {
		return fmt.Errorf("subscribe to route notifications: %w", err)
	}
	defer s.Close()
	if err := h.AddrAdd(l, addrOf(p)); err != nil {
		return err // EEXIST included: an address already there has had its route for a while
	}
	deadline := time.Now().Add(localRouteWait)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("the kernel did not route the address locally within %v", localRouteWait)
		}
		tv := unix.NsecToTimeval(left.Nanoseconds())
		if err := s.SetReceiveTimeout(&tv); err != nil {
			return fmt.Errorf("route notifications: %w", err)
		}
		msgs, _, err := s.Receive()
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("route notifications: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Type == unix.RTM_NEWROUTE && isLocalRoute6(m.Data, p.Addr()) {
				return nil
			}
		}
	}
}

// isLocalRoute6 tells whether an RTM_NEWROUTE payload announces the local route (type local,
// /128) of a.
func isLocalRoute6(data []byte, a netip.Addr) bool {
	if len(data) < unix.SizeofRtMsg {
		return false
	}
	rt := nl.DeserializeRtMsg(data)
	if rt.Family != unix.AF_INET6 || rt.Dst_len != 128 || rt.Type != unix.RTN_LOCAL {
		return false
	}
	attrs, err := nl.ParseRouteAttr(data[unix.SizeofRtMsg:])
	if err != nil {
		return false
	}
	for _, at := range attrs {
		if at.Attr.Type == unix.RTA_DST {
			dst, ok := netip.AddrFromSlice(at.Value)
			return ok && dst == a
		}
	}
	return false
}

// DelAddr implements LinkManager.
func (n *Netlink) DelAddr(ctx context.Context, name string, addr netip.Prefix) error {
	return n.run(ctx, func(h *netlink.Handle) error {
		l, err := linkByName(h, name)
		if err != nil {
			return err
		}
		if err := h.AddrDel(l, addrOf(addr)); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			return fmt.Errorf("link %s: delete address %s: %w", name, addr, err)
		}
		return nil
	})
}

// Sysctl implements LinkManager.
func (n *Netlink) Sysctl(key string) (string, error) {
	var val string
	err := n.runPlain(func() error {
		b, err := os.ReadFile(sysctlPath(key))
		val = strings.TrimSpace(string(b))
		return err
	})
	if err != nil {
		return "", fmt.Errorf("sysctl %s: %w", key, err)
	}
	return val, nil
}

// SetSysctl implements LinkManager.
func (n *Netlink) SetSysctl(key, value string) error {
	err := n.runPlain(func() error {
		return os.WriteFile(sysctlPath(key), []byte(value+"\n"), 0o644)
	})
	if err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", filepath.Clean("/"+key))
}
