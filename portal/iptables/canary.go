package iptables

// canary.go: the cheap check that lets Sync repair our chains every sync period (the runner's
// --iptables-sync-period), not only at the full read-back every VerifyPeriod. Reading the tables
// back (iptables-save of filter and nat, parsed and compared) costs about as much as the rules
// are many: at 10,000 service ports 0.3-1 s of iptables-save alone, too much to run every few
// seconds. The canary costs one `iptables -n -L KUBE-PORTALS-CANARY` per table: that lists one
// small chain, and its header carries the number of rules that jump to it, which the kernel
// keeps (iptables-nft reads it from the chain's use count). Every other chain of ours ends with a
// jump to the canary, the kernel path's included (KUBE-SERVICES, KUBE-MARK-MASQ, KUBE-SVC-*,
// KUBE-SEP-*...: their number changes with the Services, and the count wanted is read off the
// state Sync believes live), so a flush of any of them, of the whole table, or the table's deletion
// (a firewall reload) lowers the count or removes the chain, and the next periodic Sync reads
// everything back and repairs it. What the canary cannot see (a rule of ours edited in place, or
// a jump from a built-in chain deleted) is still found by the full read-back.

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// ChainReferencer is a Runner that can count the rules jumping to a chain, and the chain's own,
// without reading the rules of the table (ExecRunner and Fake are). With a runner that is not,
// Sync repairs only at its full read-back every VerifyPeriod.
type ChainReferencer interface {
	// References returns how many rules jump to chain in table and how many rules it has;
	// exists is false if the chain does not exist.
	References(ctx context.Context, fam portal.Family, table, chain string) (refs, rules int, exists bool, err error)
}

var (
	_ ChainReferencer = (*ExecRunner)(nil)
	_ ChainReferencer = (*Fake)(nil)
)

// referencesHeader is the first line of `iptables -n -L CHAIN` for a user chain.
var referencesHeader = regexp.MustCompile(`^Chain \S+ \((\d+) references?\)`)

// References implements ChainReferencer with `iptables -n -L chain`: a header with the count, a
// line of column titles, then a line per rule.
func (r *ExecRunner) References(ctx context.Context, fam portal.Family, table, chain string) (int, int, bool, error) {
	out, err := r.run(ctx, nil, r.binary(fam, ""), "-w", r.wait(), "-t", table, "-n", "-L", chain)
	var ee *ExitError
	if errors.As(err, &ee) && ee.Code == 1 {
		return 0, 0, false, nil // "No chain/target/match by that name."
	}
	if err != nil {
		return 0, 0, false, err
	}
	m := referencesHeader.FindSubmatch(out)
	if m == nil {
		return 0, 0, false, fmt.Errorf("%s -L %s: no reference count in %.80q", r.binary(fam, ""), chain, out)
	}
	n, err := strconv.Atoi(string(m[1]))
	rules := max(len(strings.Split(strings.TrimSpace(string(out)), "\n"))-2, 0)
	return n, rules, true, err
}

// References implements ChainReferencer.
func (f *Fake) References(_ context.Context, fam portal.Family, table, chain string) (int, int, bool, error) {
	if err := f.check(fam, ""); err != nil {
		return 0, 0, false, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.commands++
	t, ok := f.family(fam)[table]
	if !ok {
		return 0, 0, false, nil
	}
	own, ok := t.chains[chain]
	if !ok {
		return 0, 0, false, nil
	}
	n := 0
	for _, c := range t.chains {
		for _, r := range c.rules {
			if jumpTarget(r) == chain {
				n++
			}
		}
	}
	return n, len(own.rules), true, nil
}

// canaryIntact checks the canary of every table Sync believes it programmed: the chain is there,
// with its one rule, and has one reference per other chain of ours. Any doubt (a failed check included) is false,
// and the caller reads the tables back. No ChainReferencer means true (nothing to check cheaply).
func (p *Portals) canaryIntact(ctx context.Context) bool {
	r, ok := p.runner.(ChainReferencer)
	if !ok {
		return true
	}
	for _, fam := range portal.Families {
		for _, table := range tables {
			st := p.live[fam][table]
			if st == nil {
				continue
			}
			_, has := st.chains[ChainCanary]
			want := canaryRefs(st)
			if !has {
				continue // programmed by a version without the canary: the next change adds it
			}
			p.count(func(s *Stats) { s.CanaryChecks++ })
			refs, rules, exists, err := r.References(ctx, fam, table, ChainCanary)
			if err == nil && exists && refs == want && rules == 1 {
				continue
			}
			log := p.cfg.Logger.WithFields(map[string]any{"family": fam.String(), "table": table, "references": refs, "want": want})
			if err != nil {
				log = log.WithError(err)
			}
			log.Warn("Portal canary chain gone or missing references: our chains were flushed or deleted; reading them back")
			return false
		}
	}
	return true
}
