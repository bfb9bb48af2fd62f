// Package bind is the portal mode for nodes without NAT: every service IP becomes a local
// address on one link (kube-portal0), so the proxy sockets listen on the service IPs and ports
// themselves. The link and its addresses are reconciled by diff through the narrow LinkManager
// seam; Netlink implements it with github.com/vishvananda/netlink, FakeLink in memory.
package bind

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The defaults of the bind portals.
const (
	DefaultInterface = "kube-portal0"
	LinkTypeDummy    = "dummy"
	// LinkTypeBridge is the stand-in for kernels built without the dummy driver: a bridge that
	// never gets a port carries local addresses just as well.
	LinkTypeBridge = "bridge"
)

// The sysctls that keep the node from answering ARP on its LAN for addresses that live on the
// portal interface; kube-proxy's IPVS mode sets the same two for kube-ipvs0 (with strictARP).
const (
	sysctlARPIgnore   = "net/ipv4/conf/all/arp_ignore"
	sysctlARPAnnounce = "net/ipv4/conf/all/arp_announce"
)

// arpSysctls lists each sysctl, the value we set, and the values that already do the job. The
// kernel uses the larger of conf/all and conf/<interface>, so "all" covers every LAN interface.
var arpSysctls = []struct {
	key, value string
	ok         []string
}{
	// 1: answer only for addresses on the interface the request came in on; 2 (also same subnet)
	// and 8 (never answer) are stricter. 3 would still answer for global addresses.
	{sysctlARPIgnore, "1", []string{"1", "2", "8"}},
	// 2: ARP requests the node sends name an address of the outgoing interface as their source,
	// never a service IP that a reply from a proxy socket carries.
	{sysctlARPAnnounce, "2", []string{"2"}},
}

// Config configures the bind portals.
type Config struct {
	// Interface is the link that carries the service addresses; "" means DefaultInterface.
	Interface string
	// LinkType is the kind of link to create. "" means LinkTypeDummy, which falls back to
	// LinkTypeBridge (with one log line) when the kernel has no dummy driver; any other kind is
	// used as it is.
	LinkType string
	// LeaveARPSysctls leaves arp_ignore and arp_announce to the operator. Without it a Sync that
	// cannot set them adds no address.
	LeaveARPSysctls bool
	Logger          logrus.FieldLogger
}

func (c Config) withDefaults() Config {
	if c.Interface == "" {
		c.Interface = DefaultInterface
	}
	if c.LinkType == "" {
		c.LinkType = LinkTypeDummy
	}
	if c.Logger == nil {
		c.Logger = portal.DiscardLogger()
	}
	return c
}

// Portals is the portal implementation for nodes without NAT: every cluster IP, external IP and
// load-balancer IP becomes a /32 (/128) address on one link, so the proxy sockets listen on the
// service addresses and ports themselves and no iptables rule is needed. Sync reconciles the
// link's addresses by diff; the link belongs to us, and any other address on it is removed.
type Portals struct {
	cfg  Config
	link LinkManager

	mu      sync.Mutex // serialises Sync and Cleanup
	skipped map[netip.Addr]bool

	viewMu sync.Mutex
	addrs  []netip.Addr
	kind   string
}

var _ portal.Portals = (*Portals)(nil)

// New returns the bind portals. It touches nothing: the first Sync sets the sysctls, creates
// the link and adds the addresses.
func New(cfg Config, link LinkManager) *Portals {
	return &Portals{cfg: cfg.withDefaults(), link: link, skipped: map[netip.Addr]bool{}}
}

// Sync makes the link carry exactly the service addresses of specs (ProxyPort is not used: the
// sockets listen on the service ports). The ARP sysctls come first, then the link, then the
// addresses: new ones are added before stale ones are removed, so an address that stays wanted is
// never missing, across restarts too. A failed address is named in the error and retried by the
// next Sync, which reads the link back.
func (b *Portals) Sync(ctx context.Context, specs []portal.Spec) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	want := b.wanted(specs)
	if err := b.ensureSysctls(); err != nil {
		return err
	}
	kind, err := b.ensureLink(ctx)
	if err != nil {
		return err
	}
	have, err := b.link.Addrs(ctx, b.cfg.Interface)
	if err != nil {
		return fmt.Errorf("portal bind %s: list addresses: %w", b.cfg.Interface, err)
	}
	plan := planAddrs(want, have)
	errs := b.apply(ctx, plan, want)
	if len(errs) == 0 {
		if !b.published(kind, plan, want) {
			b.publish(kind, slices.Collect(maps.Keys(want)))
		}
		if n := len(plan.add) + len(plan.del) + len(plan.replace); n > 0 {
			b.cfg.Logger.WithFields(logrus.Fields{"interface": b.cfg.Interface, "added": len(plan.add),
				"removed": len(plan.del) + len(plan.replace), "addresses": len(want)}).Info("Portal addresses synced")
		}
		return nil
	}
	// Publish what is really there after a partial failure.
	if now, err := b.link.Addrs(ctx, b.cfg.Interface); err == nil {
		b.publish(kind, now)
	}
	return errors.Join(errs...)
}

// wanted maps each service address (as a host prefix) to the first service port that has it.
// Addresses no service IP can be are skipped, with one log line each.
func (b *Portals) wanted(specs []portal.Spec) map[netip.Prefix]service.ServicePortName {
	// The proxier passes them sorted; only then is the copy saved (10,000 specs: 2 MB a Sync).
	sorted := specs
	if !slices.IsSortedFunc(specs, portal.CompareSpecs) {
		sorted = slices.Clone(specs)
		slices.SortFunc(sorted, portal.CompareSpecs)
	}
	want := make(map[netip.Prefix]service.ServicePortName, len(specs))
	for _, s := range sorted {
		for _, ips := range [][]netip.Addr{s.ClusterIPs, s.ExternalIPs, s.LoadBalancerIPs} {
			for _, ip := range ips {
				ip = ip.Unmap()
				if !usableServiceIP(ip) {
					if !b.skipped[ip] {
						b.skipped[ip] = true
						b.cfg.Logger.WithFields(logrus.Fields{"service": s.Name.String(), "portal": ip.String()}).
							Warn("Not adding an address that cannot be a service IP to the portal interface")
					}
					continue
				}
				p := netip.PrefixFrom(ip, ip.BitLen())
				if _, ok := want[p]; !ok {
					want[p] = s.Name
				}
			}
		}
	}
	return want
}

// usableServiceIP refuses what would break the node if it were put on the portal link.
func usableServiceIP(ip netip.Addr) bool {
	return ip.IsValid() && !ip.IsUnspecified() && !ip.IsLoopback() && !ip.IsMulticast() &&
		!ip.IsLinkLocalUnicast() && !ip.IsLinkLocalMulticast()
}

// ensureSysctls checks the ARP sysctls on every Sync (someone may reset them) and sets those that
// do not already keep service IPs off the LAN.
func (b *Portals) ensureSysctls() error {
	if b.cfg.LeaveARPSysctls {
		return nil
	}
	for _, s := range arpSysctls {
		cur, err := b.link.Sysctl(s.key)
		if err != nil {
			return fmt.Errorf("portal bind %s: %w", b.cfg.Interface, err)
		}
		if slices.Contains(s.ok, cur) {
			continue
		}
		if err := b.link.SetSysctl(s.key, s.value); err != nil {
			return fmt.Errorf("portal bind %s: keep service IPs out of ARP: %w", b.cfg.Interface, err)
		}
		b.cfg.Logger.WithFields(logrus.Fields{"sysctl": s.key, "old": cur, "new": s.value}).
			Info("Set sysctl so the node does not answer ARP for service IPs on its other interfaces")
	}
	return nil
}

// kinds is the link kinds we create, in order of preference; a link of any of them is ours.
func (b *Portals) kinds() []string {
	if b.cfg.LinkType == LinkTypeDummy {
		return []string{LinkTypeDummy, LinkTypeBridge}
	}
	return []string{b.cfg.LinkType}
}

// ensureLink creates the link when it is missing and brings it up; it refuses a link of that name
// that is not of our kinds, which is someone else's.
func (b *Portals) ensureLink(ctx context.Context) (string, error) {
	name := b.cfg.Interface
	kind, err := b.link.LinkKind(ctx, name)
	switch {
	case errors.Is(err, ErrLinkNotFound):
		return b.createLink(ctx)
	case err != nil:
		return "", fmt.Errorf("portal bind %s: %w", name, err)
	case !slices.Contains(b.kinds(), kind):
		return "", fmt.Errorf("portal bind %s: a link of that name and kind %q exists and is not ours (we create %v); remove it or choose another interface name", name, kind, b.kinds())
	}
	if err := b.link.EnsureLink(ctx, name, kind); err != nil {
		return "", fmt.Errorf("portal bind %s: bring up: %w", name, err)
	}
	return kind, nil
}

func (b *Portals) createLink(ctx context.Context) (string, error) {
	name := b.cfg.Interface
	kinds := b.kinds()
	var errs []error
	for i, kind := range kinds {
		err := b.link.EnsureLink(ctx, name, kind)
		if err == nil {
			if i > 0 {
				b.cfg.Logger.WithFields(logrus.Fields{"interface": name, "kind": kind, "reason": errs[len(errs)-1].Error()}).
					Info("The kernel has no " + kinds[0] + " link type; the portal interface is a " + kind + " without ports instead")
			}
			return kind, nil
		}
		errs = append(errs, err)
		if !errors.Is(err, ErrKindUnsupported) {
			break
		}
	}
	return "", fmt.Errorf("portal bind %s: create link: %w", name, errors.Join(errs...))
}

// addrPlan is the address changes of one Sync, each list sorted. replace holds addresses we want
// with another prefix length (e.g. 10.96.0.10/24 where 10.96.0.10/32 is wanted); they go first,
// since IPv6 allows one prefix length per address.
type addrPlan struct {
	replace, add, del []netip.Prefix
}

// planAddrs diffs the wanted host prefixes against the link's addresses. IPv6 link-local
// addresses, which the kernel may give the link itself, are left alone. With nothing to change
// (every Sync but a few) it allocates nothing.
func planAddrs(want map[netip.Prefix]service.ServicePortName, have []netip.Prefix) addrPlan {
	var plan addrPlan
	found := 0 // wanted prefixes on the link (the kernel lists each once)
	for _, p := range have {
		a := p.Addr().Unmap()
		_, wanted := want[p]
		// Wanted prefixes are host prefixes, so another length of a wanted address is that.
		_, wantedAddr := want[netip.PrefixFrom(a, a.BitLen())]
		switch {
		case wanted:
			found++
		case p.Addr().Is6() && p.Addr().IsLinkLocalUnicast():
		case wantedAddr:
			plan.replace = append(plan.replace, p)
		default:
			plan.del = append(plan.del, p)
		}
	}
	if found < len(want) {
		present := make(map[netip.Prefix]bool, len(have))
		for _, p := range have {
			present[p] = true
		}
		for p := range want {
			if !present[p] {
				plan.add = append(plan.add, p)
			}
		}
	}
	for _, l := range [][]netip.Prefix{plan.replace, plan.add, plan.del} {
		slices.SortFunc(l, comparePrefix)
	}
	return plan
}

// apply carries out the plan, trying every address; it returns one error per failed address.
func (b *Portals) apply(ctx context.Context, plan addrPlan, want map[netip.Prefix]service.ServicePortName) []error {
	name := b.cfg.Interface
	var errs []error
	del := func(p netip.Prefix) {
		if err := b.link.DelAddr(ctx, name, p); err != nil {
			errs = append(errs, fmt.Errorf("portal bind %s: remove address %s: %w", name, p, err))
		}
	}
	for _, p := range plan.replace {
		del(p)
	}
	for _, p := range plan.add {
		if err := b.link.AddAddr(ctx, name, p); err != nil {
			errs = append(errs, fmt.Errorf("portal %s: bind %s: add address %s: %w", want[p], name, p, err))
		}
	}
	for _, p := range plan.del {
		del(p)
	}
	return errs
}

// Cleanup deletes the link and with it every address; a missing link is fine. A link of that name
// that is not of our kinds is left alone (and reported). The ARP sysctls stay as they are: other
// software (IPVS, MetalLB) may rely on them too.
func (b *Portals) Cleanup(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	name := b.cfg.Interface
	kind, err := b.link.LinkKind(ctx, name)
	switch {
	case errors.Is(err, ErrLinkNotFound):
		b.publish("", nil)
		return nil
	case err != nil:
		return fmt.Errorf("portal bind %s: cleanup: %w", name, err)
	case !slices.Contains(b.kinds(), kind):
		return fmt.Errorf("portal bind %s: cleanup: the link has kind %q, not one of ours (%v); left alone", name, kind, b.kinds())
	}
	if err := b.link.DeleteLink(ctx, name); err != nil && !errors.Is(err, ErrLinkNotFound) {
		return fmt.Errorf("portal bind %s: cleanup: %w", name, err)
	}
	b.publish("", nil)
	return nil
}

// published tells whether the debug view already shows what a Sync that worked leaves: with
// nothing changed on the link, the same kind and the same addresses as the last publish.
func (b *Portals) published(kind string, plan addrPlan, want map[netip.Prefix]service.ServicePortName) bool {
	if len(plan.add)+len(plan.del)+len(plan.replace) > 0 {
		return false
	}
	b.viewMu.Lock()
	defer b.viewMu.Unlock()
	if b.kind != kind || len(b.addrs) != len(want) {
		return false
	}
	for p := range want {
		if _, ok := slices.BinarySearchFunc(b.addrs, p.Addr(), netip.Addr.Compare); !ok {
			return false
		}
	}
	return true
}

func (b *Portals) publish(kind string, prefixes []netip.Prefix) {
	addrs := make([]netip.Addr, 0, len(prefixes))
	for _, p := range prefixes {
		if !(p.Addr().Is6() && p.Addr().IsLinkLocalUnicast()) {
			addrs = append(addrs, p.Addr())
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	addrs = slices.Compact(addrs)
	b.viewMu.Lock()
	defer b.viewMu.Unlock()
	b.kind, b.addrs = kind, addrs
}

// Addresses lists the service addresses on the link after the last Sync, sorted, for a debug
// view.
func (b *Portals) Addresses() []netip.Addr {
	b.viewMu.Lock()
	defer b.viewMu.Unlock()
	return slices.Clone(b.addrs)
}

// Kind is the kind of the link after the last Sync ("dummy", or "bridge" after the fallback); ""
// before the first Sync and after Cleanup.
func (b *Portals) Kind() string {
	b.viewMu.Lock()
	defer b.viewMu.Unlock()
	return b.kind
}
