package bind

import (
	"context"
	"errors"
	"net/netip"
)

// LinkManager is the narrow seam between the bind portals and the kernel of one network
// namespace: the link that carries the service addresses, its addresses, and the sysctls that
// keep the node from answering ARP for them. Netlink talks to the kernel; FakeLink keeps the same
// state in memory so the diff logic runs in tests.
type LinkManager interface {
	// LinkKind is the kind of the link named name ("dummy", "bridge", "veth", "" for a plain
	// device), or an error wrapping ErrLinkNotFound.
	LinkKind(ctx context.Context, name string) (string, error)
	// EnsureLink creates the link with kind when there is none of that name, and brings it up. It
	// fails with ErrKindUnsupported when the kernel has no such link type, and does not touch a link
	// of that name but another kind.
	EnsureLink(ctx context.Context, name, kind string) error
	// DeleteLink deletes the link and with it its addresses; ErrLinkNotFound when absent.
	DeleteLink(ctx context.Context, name string) error
	// Addrs lists the addresses on the link with their prefix lengths.
	Addrs(ctx context.Context, name string) ([]netip.Prefix, error)
	// AddAddr adds an address (an IPv6 one without duplicate address detection) and returns
	// once the kernel delivers its packets locally; one already present is not an error.
	AddAddr(ctx context.Context, name string, addr netip.Prefix) error
	// DelAddr removes an address; one already gone is not an error.
	DelAddr(ctx context.Context, name string, addr netip.Prefix) error
	// Sysctl reads /proc/sys/<key>, with key spelled with slashes ("net/ipv4/conf/all/arp_ignore");
	// SetSysctl writes it.
	Sysctl(key string) (string, error)
	SetSysctl(key, value string) error
}

var (
	// ErrLinkNotFound means there is no link of that name.
	ErrLinkNotFound = errors.New("link not found")
	// ErrKindUnsupported means the kernel does not know the link type (e.g. no dummy driver).
	ErrKindUnsupported = errors.New("link type not supported by the kernel")
)

var (
	_ LinkManager = (*Netlink)(nil)
	_ LinkManager = (*FakeLink)(nil)
)
