package bind

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
)

// FakeLink is an in-memory LinkManager: links with a kind, an up flag and addresses, and sysctls.
// It records every change it makes (Ops) so tests can check what was done and in which order. It
// lives in a non-test file so other packages' tests can use it.
type FakeLink struct {
	// Unsupported lists link kinds the "kernel" does not know, e.g. {"dummy": true} for this
	// project's CI kernel.
	Unsupported map[string]bool
	// Fail, when set, runs before each change ("add-link", "set-up", "del-link", "add-addr",
	// "del-addr", "set-sysctl") with its object; an error fails the change unapplied.
	Fail func(op, object string) error

	mu      sync.Mutex
	links   map[string]*fakeLinkState
	sysctls map[string]string
	ops     []string
}

type fakeLinkState struct {
	kind  string
	up    bool
	addrs map[netip.Prefix]bool
}

// NewFakeLink returns a fake with no links and the kernel's default ARP sysctls (0).
func NewFakeLink() *FakeLink {
	return &FakeLink{
		links: map[string]*fakeLinkState{},
		sysctls: map[string]string{
			sysctlARPIgnore:   "0",
			sysctlARPAnnounce: "0",
		},
	}
}

// AddLink creates a link as someone else would, without recording an op: a leftover of a previous
// run, or a foreign link of the same name.
func (f *FakeLink) AddLink(name, kind string, up bool, addrs ...netip.Prefix) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := &fakeLinkState{kind: kind, up: up, addrs: map[netip.Prefix]bool{}}
	for _, a := range addrs {
		l.addrs[a] = true
	}
	f.links[name] = l
}

// SetSysctlValue sets a sysctl without recording an op, as the node's configuration would.
func (f *FakeLink) SetSysctlValue(key, value string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sysctls[key] = value
}

// change records op and applies it, unless Fail refuses it.
func (f *FakeLink) change(op, object string, apply func()) error {
	if f.Fail != nil {
		if err := f.Fail(op, object); err != nil {
			return fmt.Errorf("fake %s %s: %w", op, object, err)
		}
	}
	f.ops = append(f.ops, op+" "+object)
	apply()
	return nil
}

// LinkKind implements LinkManager.
func (f *FakeLink) LinkKind(_ context.Context, name string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.links[name]
	if !ok {
		return "", fmt.Errorf("link %s: %w", name, ErrLinkNotFound)
	}
	return l.kind, nil
}

// EnsureLink implements LinkManager.
func (f *FakeLink) EnsureLink(_ context.Context, name, kind string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.links[name]
	if !ok {
		if f.Unsupported[kind] {
			return fmt.Errorf("link %s: %w: %s", name, ErrKindUnsupported, kind)
		}
		l = &fakeLinkState{kind: kind, addrs: map[netip.Prefix]bool{}}
		if err := f.change("add-link", name+" "+kind, func() { f.links[name] = l; l.up = true }); err != nil {
			return err
		}
	}
	if l.kind != kind {
		return fmt.Errorf("link %s: exists with kind %q, not %q", name, l.kind, kind)
	}
	if !l.up {
		return f.change("set-up", name, func() { l.up = true })
	}
	return nil
}

// DeleteLink implements LinkManager.
func (f *FakeLink) DeleteLink(_ context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.link(name); err != nil {
		return err
	}
	return f.change("del-link", name, func() { delete(f.links, name) })
}

// link is the link called name, or ErrLinkNotFound as the real LinkManager says it. f.mu is held.
func (f *FakeLink) link(name string) (*fakeLinkState, error) {
	l, ok := f.links[name]
	if !ok {
		return nil, fmt.Errorf("link %s: %w", name, ErrLinkNotFound)
	}
	return l, nil
}

// Addrs implements LinkManager.
func (f *FakeLink) Addrs(_ context.Context, name string) ([]netip.Prefix, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, err := f.link(name)
	if err != nil {
		return nil, err
	}
	return slices.SortedFunc(maps.Keys(l.addrs), comparePrefix), nil
}

// AddAddr implements LinkManager.
func (f *FakeLink) AddAddr(_ context.Context, name string, addr netip.Prefix) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, err := f.link(name)
	if err != nil {
		return err
	}
	if l.addrs[addr] {
		return nil
	}
	return f.change("add-addr", name+" "+addr.String(), func() { l.addrs[addr] = true })
}

// DelAddr implements LinkManager.
func (f *FakeLink) DelAddr(_ context.Context, name string, addr netip.Prefix) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, err := f.link(name)
	if err != nil {
		return err
	}
	if !l.addrs[addr] {
		return nil
	}
	return f.change("del-addr", name+" "+addr.String(), func() { delete(l.addrs, addr) })
}

// Sysctl implements LinkManager.
func (f *FakeLink) Sysctl(key string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.sysctls[key]
	if !ok {
		return "", fmt.Errorf("sysctl %s: no such key", key)
	}
	return v, nil
}

// SetSysctl implements LinkManager.
func (f *FakeLink) SetSysctl(key, value string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.change("set-sysctl", key+"="+value, func() { f.sysctls[key] = value })
}

// Ops returns the changes made through the LinkManager methods, in order, e.g.
// "add-addr kube-portal0 10.96.0.10/32".
func (f *FakeLink) Ops() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ops)
}

// ResetOps forgets the recorded changes.
func (f *FakeLink) ResetOps() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ops = nil
}

// Dump prints the links by name with their addresses sorted, then the sysctls by key:
//
//	link kube-portal0 dummy up
//	  10.96.0.10/32
//	sysctl net/ipv4/conf/all/arp_announce=2
func (f *FakeLink) Dump() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var sb strings.Builder
	for _, name := range slices.Sorted(maps.Keys(f.links)) {
		l := f.links[name]
		state := "down"
		if l.up {
			state = "up"
		}
		fmt.Fprintf(&sb, "link %s %s %s\n", name, l.kind, state)
		for _, a := range slices.SortedFunc(maps.Keys(l.addrs), comparePrefix) {
			sb.WriteString("  " + a.String() + "\n")
		}
	}
	for _, k := range slices.Sorted(maps.Keys(f.sysctls)) {
		fmt.Fprintf(&sb, "sysctl %s=%s\n", k, f.sysctls[k])
	}
	return sb.String()
}

func comparePrefix(a, b netip.Prefix) int {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c
	}
	return a.Bits() - b.Bits()
}
