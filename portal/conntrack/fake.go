package conntrack

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
)

// Fake records what it is asked to clear. It lives outside the test files so that other
// packages' tests can check what a service change clears.
type Fake struct {
	mu      sync.Mutex
	cleared []Flows
	// untranslated are the ClearUntranslated calls, one slice each.
	untranslated [][]Flows
	// Err, if set, is returned by every ClearUDP (after recording the call).
	Err error
}

// ClearUDP implements Interface.
func (f *Fake) ClearUDP(_ context.Context, flows Flows) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	flows.Addrs, flows.ProxyPorts, flows.Endpoints = slices.Clone(flows.Addrs), slices.Clone(flows.ProxyPorts), slices.Clone(flows.Endpoints)
	f.cleared = append(f.cleared, flows)
	return f.Err
}

// ClearUntranslated implements Interface.
func (f *Fake) ClearUntranslated(_ context.Context, fs []Flows) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	call := make([]Flows, len(fs))
	for i, fl := range fs {
		fl.Addrs = slices.Clone(fl.Addrs)
		call[i] = fl
	}
	f.untranslated = append(f.untranslated, call)
	return f.Err
}

// DumpUntranslated lists the ClearUntranslated calls one per line, in call order, each as its
// sorted destinations: "10.96.0.10:53 nodeport 30053, 10.96.0.11:53".
func (f *Fake) DumpUntranslated() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var lines []string
	for _, call := range f.untranslated {
		var parts []string
		for _, fl := range call {
			parts = append(parts, describe(fl))
		}
		slices.Sort(parts)
		lines = append(lines, strings.Join(parts, ", "))
	}
	return strings.Join(lines, "\n")
}

// Dump lists the cleared entries one per line, sorted: "udp <ip>:<port>" for an address and
// "udp nodeport <port>" for a node port, each followed by " via <ports>" when narrowed to the
// entries redirected to those proxy ports and " to <endpoints>" when narrowed to those DNATed to
// those endpoints.
func (f *Fake) Dump() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var lines []string
	for _, fl := range f.cleared {
		via := ""
		if len(fl.ProxyPorts) > 0 {
			via = fmt.Sprintf(" via %v", fl.ProxyPorts)
		}
		if len(fl.Endpoints) > 0 {
			via += fmt.Sprintf(" to %v", fl.Endpoints)
		}
		for _, a := range fl.Addrs {
			lines = append(lines, "udp "+netip.AddrPortFrom(a, fl.Port).String()+via)
		}
		if fl.NodePort != 0 {
			lines = append(lines, fmt.Sprintf("udp nodeport %d%s", fl.NodePort, via))
		}
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// Reset forgets the recorded calls.
func (f *Fake) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleared, f.untranslated = nil, nil
}
