// Package iptables is the default portal mode: the legacy userspace KUBE-PORTALS and
// KUBE-NODEPORT chains in the nat (and filter) table steer service traffic to the proxy sockets.
//
// Reading state and one-off commands (finding the binaries, nft or legacy, whether a chain
// exists, --cleanup's deletions) go through github.com/coreos/go-iptables. Every Sync writes
// its changes with `iptables-restore --noflush` instead, one transaction per table: go-iptables
// has no API for an atomic batch, and one command per rule is what made the legacy proxy take
// minutes at scale and leave half-applied states behind. The Runner interface is the seam both
// go through; Fake keeps the tables in memory so the rule-building code runs in tests.
package iptables

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// ErrNATUnavailable means this node's iptables cannot REDIRECT/DNAT (no nat table, or its targets
// are missing). Portals cannot work here; the bind mode does not need NAT.
var ErrNATUnavailable = errors.New("the iptables nat table cannot REDIRECT/DNAT on this node; run with --portal-mode=bind")

// Stats counts what the iptables portals did.
type Stats struct {
	// Restores is the number of iptables-restore runs, RestoreFailures how many of them failed.
	Restores        uint64
	RestoreFailures uint64
	// ReadBacks counts iptables-save runs; Repairs how many read-backs found the live rules
	// different from what was last applied (someone else changed or flushed them).
	ReadBacks uint64
	Repairs   uint64
	// CanaryChecks counts the cheap checks of the canary chain (canary.go) made by the Syncs
	// that had nothing to change; one that fails makes its Sync read the tables back.
	CanaryChecks uint64
	// Rules is the number of rules in our chains, all families, as last applied.
	Rules int
}

// Portals programs the portal chains with iptables-restore. Each Sync computes the wanted rules
// of every family and table, diffs them against what it believes is live, and sends the
// difference in one `iptables-restore --noflush` per table (nothing when nothing changed). Every
// VerifyPeriod it first reads the live chains back, so changes made by others are repaired; a
// Sync with nothing to change (the periodic one) checks the canary chain, and reads back at once
// if one of our chains or tables was flushed or deleted (canary.go).
type Portals struct {
	cfg    Config
	runner Runner

	mu         sync.Mutex // serialises Sync and Cleanup
	live       map[portal.Family]map[string]*tableState
	skipped    map[portal.Family]string // families skipped, with the reason already logged
	lastVerify time.Time
	invalid    map[string]bool
	// natRepaired: this Sync restored a nat table found changed by others (AfterNATRepair).
	natRepaired bool
	// applied is the sorted specs of the last Sync that left every table known and as wanted, so a
	// repeat Sync with the same specs returns without rebuilding 10,000s of rule strings.
	applied []portal.Spec

	viewMu sync.Mutex // guards stats, view and kernelPorts; never held while running a command
	stats  Stats
	view   map[portal.Family]map[string]*tableState
	// kernelPorts counts the specs on the kernel path in the last Sync.
	kernelPorts int

	// counterMu serialises KernelCounters and guards its cache.
	counterMu  sync.Mutex
	counters   []portal.EndpointCounter
	countersAt time.Time
}

// New returns the iptables portals. It runs nothing: the first Sync reads the live tables
// and programs them.
func New(cfg Config, runner Runner) *Portals {
	return &Portals{
		cfg:     cfg.withDefaults(),
		runner:  runner,
		live:    map[portal.Family]map[string]*tableState{},
		skipped: map[portal.Family]string{},
		invalid: map[string]bool{},
		view:    map[portal.Family]map[string]*tableState{},
	}
}

// SetHostIPs replaces the node IP per family (Config.HostIPs, the target of HOST DNAT rules);
// the next Sync rebuilds the rules with it. The daemon builds the portals with the interfaces'
// addresses so that a restart reopens its proxy ports before it has read the Node object, and
// sets the Node's addresses once it has them (before the sources start, and whenever they change).
func (p *Portals) SetHostIPs(ips map[portal.Family]netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cfg.HostIPs = maps.Clone(ips)
	p.skipped = map[portal.Family]string{} // a family without a node IP may have one now
	p.applied = nil                        // the next Sync builds the rules again
}

// SetNoRandomFully sets Config.NoRandomFully (HasRandomFully's answer) after construction: a
// restart probes for it after reopening its proxy ports, off their way; the next Sync builds the
// rules with it.
func (p *Portals) SetNoRandomFully(no bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cfg.NoRandomFully != no {
		p.cfg.NoRandomFully = no
		p.applied = nil
	}
}

// Sync makes the portal chains of every family match specs. A failed restore leaves the other
// tables and families applied; it is counted, returned, and retried by the next Sync (the failed
// table is read back first, since its state is then unknown).
func (p *Portals) Sync(ctx context.Context, specs []portal.Spec) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.cfg.Clock.Now()
	verify := p.lastVerify.IsZero() || now.Sub(p.lastVerify) >= p.cfg.VerifyPeriod
	sorted := sortedSpecs(specs)
	if !verify && p.applied != nil && slices.EqualFunc(sorted, p.applied, specEqual) {
		if p.canaryIntact(ctx) {
			return nil
		}
		verify = true
	}
	p.countKernelPorts(sorted)
	p.applied = nil
	verified, err := p.syncFamilies(ctx, sorted, verify)
	if verify && verified {
		p.lastVerify = now
	}
	if p.natRepaired && p.cfg.AfterNATRepair != nil {
		p.cfg.AfterNATRepair(ctx, sorted)
	}
	p.natRepaired = false
	if err == nil {
		// Copied only now, when the rules and restore inputs of this sync are garbage: a copy
		// of 10,000 specs is 2 MB, which the first sync's peak need not hold.
		p.applied = cloneSpecs(sorted)
	}
	return err
}

// sortedSpecs is specs in portal.CompareSpecs order: specs itself when sorted already (the proxier
// passes them sorted), else a sorted shallow copy. It is read during the Sync only.
func sortedSpecs(specs []portal.Spec) []portal.Spec {
	if slices.IsSortedFunc(specs, portal.CompareSpecs) {
		return specs
	}
	sorted := slices.Clone(specs)
	slices.SortFunc(sorted, portal.CompareSpecs)
	return sorted
}

// cloneSpecs is a deep copy of specs, kept after the Sync: the caller may reuse its slices.
func cloneSpecs(specs []portal.Spec) []portal.Spec {
	sorted := slices.Clone(specs)
	for i := range sorted {
		s := &sorted[i]
		s.ClusterIPs, s.ExternalIPs, s.LoadBalancerIPs = slices.Clone(s.ClusterIPs), slices.Clone(s.ExternalIPs), slices.Clone(s.LoadBalancerIPs)
		s.SourceRanges = slices.Clone(s.SourceRanges)
		s.Kernel = s.Kernel.Clone()
	}
	return sorted
}

// countKernelPorts keeps, for the counters, how many of the specs are on the kernel path.
func (p *Portals) countKernelPorts(specs []portal.Spec) {
	nk := 0
	for i := range specs {
		if specs[i].Kernel != nil && p.cfg.KernelPath {
			nk++
		}
	}
	p.viewMu.Lock()
	p.kernelPorts = nk
	p.viewMu.Unlock()
}

// syncFamilies builds and syncs the rules of each enabled family. A spec that cannot have a
// portal is logged once, when it first turns up, and skipped. verified reports whether every
// read-back worked.
func (p *Portals) syncFamilies(ctx context.Context, specs []portal.Spec, verify bool) (verified bool, err error) {
	verified = true
	var errs []error
	invalid := map[string]bool{}
	for _, fam := range portal.Families {
		if !p.familyEnabled(fam) {
			continue
		}
		want, bad := buildRules(p.cfg, fam, specs)
		for _, err := range bad {
			if !p.invalid[err.Error()] && !invalid[err.Error()] {
				p.cfg.Logger.WithError(err).Warn("Skipping service port without portal")
			}
			invalid[err.Error()] = true
		}
		ok, err := p.syncFamily(ctx, fam, want, verify)
		verified = verified && ok
		if err != nil {
			errs = append(errs, err)
		}
	}
	p.invalid = invalid
	return verified, errors.Join(errs...)
}

// familyEnabled reports whether fam is programmed, logging once why it is not.
func (p *Portals) familyEnabled(fam portal.Family) bool {
	reason := p.skipped[fam]
	if reason == "" {
		bind := p.cfg.BindAddress
		switch {
		case !bind.IsUnspecified() && portal.FamilyOf(bind) != fam:
			reason = "bind address " + bind.String() + " is not of this family"
		case bind.IsUnspecified() && !p.cfg.HostIPs[fam].IsValid():
			reason = "the node has no IP address of this family"
		}
		if reason != "" {
			p.skip(fam, reason)
		}
	}
	return reason == ""
}

func (p *Portals) skip(fam portal.Family, reason string) {
	if p.skipped[fam] != "" {
		return
	}
	p.skipped[fam] = reason
	p.cfg.Logger.WithField("family", fam.String()).Info("Skipping IP family for portals: " + reason)
}

// syncFamily reads back what needs reading and restores each table that differs. ok reports
// whether every read-back worked (so the verify clock may restart).
func (p *Portals) syncFamily(ctx context.Context, fam portal.Family, want familyRules, verify bool) (ok bool, err error) {
	live := p.live[fam]
	if live == nil {
		live = map[string]*tableState{}
		p.live[fam] = live
	}
	rb, err := p.readBackTables(ctx, fam, live, verify)
	if errors.Is(err, ErrUnavailable) {
		p.skip(fam, err.Error())
		return true, nil
	}
	errs := append(rb.errs, p.restoreTables(ctx, fam, live, want, rb)...)
	p.publish(fam, live)
	return len(rb.unread) == 0, errors.Join(errs...)
}

// readBacks is what the read-backs of a family found: the tables someone else changed (repaired
// by the restore) and those that could not be read (left alone until the next Sync).
type readBacks struct {
	repair, unread map[string]bool
	errs           []error
}

// readBackTables reads back each table whose state is unknown, or every table when verifying,
// into live. Every read-back comes before the first restore: with iptables-nft, `iptables-save
// -t nat` right after filter's 10,000 guard rules went in took 0.14 s of a cold start (3 ms
// before). An error is ErrUnavailable: the family cannot be programmed at all.
func (p *Portals) readBackTables(ctx context.Context, fam portal.Family, live map[string]*tableState, verify bool) (readBacks, error) {
	rb := readBacks{repair: map[string]bool{}, unread: map[string]bool{}}
	for _, table := range tables {
		if !verify && live[table] != nil {
			continue
		}
		st, err := p.readBack(ctx, fam, table)
		if errors.Is(err, ErrUnavailable) {
			return rb, err
		}
		if err != nil {
			rb.unread[table] = true
			rb.errs = append(rb.errs, err)
			continue
		}
		if live[table] != nil && !live[table].equal(st) {
			rb.repair[table] = true
			p.count(func(s *Stats) { s.Repairs++ })
			p.cfg.Logger.WithFields(map[string]any{"family": fam.String(), "table": table}).
				Warn("Portal rules changed behind our back; repairing")
		}
		live[table] = st
	}
	return rb, nil
}

// restoreTables brings each table that was read to want, keeping live as what is in force (nil:
// unknown, read back before the next attempt).
//
// Every table's additions go in before any table's deletions: filter's, then nat's, then
// nat's stale rules go, then filter's. A service port whose endpoints arrive changes from a
// filter REJECT to a nat REDIRECT: deleting the REJECT first (both tables in turn, as before)
// left a moment where a SYN to the service was neither refused nor steered, so it was dropped
// and retransmitted a second later. Now the REDIRECT is in first (translated traffic no longer
// matches the REJECT), then the REJECT goes. The reverse change adds the REJECT before the
// REDIRECT goes. And filter's rules accepting a new proxy port still precede nat steering to it.
func (p *Portals) restoreTables(ctx context.Context, fam portal.Family, live map[string]*tableState, want familyRules, rb readBacks) []error {
	var errs []error
	plans := map[string]plan{}
	for _, table := range tables {
		if rb.unread[table] {
			continue
		}
		pl := restorePlan(table, live[table], want[table], rb.repair[table])
		if err := p.restoreAll(ctx, fam, pl.apply); err != nil {
			live[table] = nil
			errs = append(errs, err)
			continue
		}
		plans[table] = pl
	}
	for _, table := range natFirst {
		pl, ok := plans[table]
		if !ok {
			continue
		}
		if err := p.restoreAll(ctx, fam, pl.cleanup); err != nil {
			live[table] = nil
			errs = append(errs, err)
			continue
		}
		live[table] = pl.result
		if rb.repair[table] && table == tableNAT {
			p.natRepaired = true
		}
	}
	return errs
}

func (p *Portals) readBack(ctx context.Context, fam portal.Family, table string) (*tableState, error) {
	p.count(func(s *Stats) { s.ReadBacks++ })
	data, err := p.runner.Save(ctx, fam, table)
	if err != nil {
		return nil, fmt.Errorf("portal %s %s: read back: %w", fam, table, err)
	}
	st, err := parseSave(table, data)
	if err != nil {
		return nil, fmt.Errorf("portal %s %s: %w", fam, table, err)
	}
	return st, nil
}

// restoreAll runs in when it has lines. Its text exists only for the restore: streamed to the
// command when the runner can read it so, else written just before the restore and garbage after,
// so a sync never holds more than one table's input.
func (p *Portals) restoreAll(ctx context.Context, fam portal.Family, in input) error {
	if in.empty() { // not size: that walks every rule of a 10,000-port table
		return nil
	}
	if sr, ok := p.runner.(streamRestorer); ok {
		return p.restore(ctx, fam, in.table, func() error { return sr.RestoreFrom(ctx, fam, in.reader()) })
	}
	return p.restore(ctx, fam, in.table, func() error { return p.runner.Restore(ctx, fam, in.bytes()) })
}

// restore runs one restore (run), counting it and naming a failure.
func (p *Portals) restore(ctx context.Context, fam portal.Family, table string, run func() error) error {
	p.count(func(s *Stats) { s.Restores++ })
	err := run()
	if err == nil {
		return nil
	}
	p.count(func(s *Stats) { s.RestoreFailures++ })
	if table == tableNAT && !p.natWorks(ctx, fam) {
		err = fmt.Errorf("%w: %w", ErrNATUnavailable, err)
	}
	return fmt.Errorf("portal %s %s: restore: %w", fam, table, err)
}

// natProbe adds a REDIRECT and a DNAT rule to a scratch chain and removes it again, in one
// transaction: if that fails too, the failure is NAT itself, not our rules.
const natProbe = `*nat
:KUBE-PORTALS-PROBE - [0:0]
-A KUBE-PORTALS-PROBE -p tcp -j REDIRECT --to-ports 1
-A KUBE-PORTALS-PROBE -p tcp -j DNAT --to-destination %s
-F KUBE-PORTALS-PROBE
-X KUBE-PORTALS-PROBE
COMMIT
`

func (p *Portals) natWorks(ctx context.Context, fam portal.Family) bool {
	dst := "127.0.0.1:1"
	if fam == portal.IPv6 {
		dst = "[::1]:1"
	}
	return p.runner.Restore(ctx, fam, fmt.Appendf(nil, natProbe, dst)) == nil
}

func (p *Portals) count(f func(*Stats)) {
	p.viewMu.Lock()
	f(&p.stats)
	p.viewMu.Unlock()
}

// publish records the believed-live state for Rules and Stats. Table states are never modified
// once built, so sharing them is safe.
func (p *Portals) publish(fam portal.Family, live map[string]*tableState) {
	snap := map[string]*tableState{}
	for t, st := range live {
		snap[t] = st
	}
	p.viewMu.Lock()
	defer p.viewMu.Unlock()
	p.view[fam] = snap
	n := 0
	for _, ts := range p.view {
		for _, st := range ts {
			if st != nil {
				n += st.rules()
			}
		}
	}
	p.stats.Rules = n
}

// Stats returns the counters.
func (p *Portals) Stats() Stats {
	p.viewMu.Lock()
	defer p.viewMu.Unlock()
	return p.stats
}

// Rules returns our chains and jump rules as last applied, per family, in iptables-save format,
// for a debug view.
func (p *Portals) Rules() string {
	p.viewMu.Lock()
	defer p.viewMu.Unlock()
	var sb strings.Builder
	for _, fam := range portal.Families {
		ts := p.view[fam]
		if len(ts) == 0 {
			continue
		}
		sb.WriteString("# " + fam.String() + "\n")
		for _, table := range natFirst {
			if st := ts[table]; st != nil {
				sb.WriteString(render(table, st))
			} else {
				sb.WriteString("# " + table + ": unknown until the next read-back\n")
			}
		}
	}
	return sb.String()
}

func specEqual(a, b portal.Spec) bool {
	return a.Name == b.Name && a.Protocol == b.Protocol && a.Port == b.Port && a.NodePort == b.NodePort &&
		a.ProxyPort == b.ProxyPort && a.ExternalProxyPort == b.ExternalProxyPort &&
		a.RejectInternal == b.RejectInternal && a.RejectExternal == b.RejectExternal &&
		slices.Equal(a.ClusterIPs, b.ClusterIPs) && slices.Equal(a.ExternalIPs, b.ExternalIPs) &&
		slices.Equal(a.LoadBalancerIPs, b.LoadBalancerIPs) && slices.Equal(a.SourceRanges, b.SourceRanges) &&
		a.Kernel.Equal(b.Kernel)
}
