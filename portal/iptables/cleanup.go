package iptables

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Cleanup removes every chain and jump rule we own, in both families, whatever the configuration.
// Nothing to remove is not an error; a family without iptables binaries is skipped. It goes
// through go-iptables (Runner.Chains), one command at a time, nat first: per table it lists the
// chains, deletes every rule in another chain that jumps to one of ours, then flushes our chains
// and deletes them. Unlike a Sync it need not be atomic: it runs once, at --cleanup, and what
// it leaves half done a second run finishes.
func (p *Portals) Cleanup(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, fam := range portal.Families {
		chains, err := p.runner.Chains(ctx, fam)
		switch {
		case errors.Is(err, ErrUnavailable):
			p.cfg.Logger.WithField("family", fam.String()).Info("Skipping IP family for cleanup: " + err.Error())
		case err != nil:
			errs = append(errs, fmt.Errorf("portal %s cleanup: %w", fam, err))
		default:
			for _, table := range natFirst {
				if err := cleanupTable(chains, table); err != nil {
					errs = append(errs, fmt.Errorf("portal %s cleanup: %w", fam, err))
				}
			}
		}
		delete(p.live, fam)
		p.publish(fam, nil)
	}
	p.lastVerify = time.Time{}
	p.applied = nil
	return errors.Join(errs...)
}

// cleanupTable removes our jumps and chains from one table. It carries on after a failure, so
// one stuck rule does not keep the rest in place.
func cleanupTable(c Chains, table string) error {
	all, err := c.ListChains(table)
	if err != nil {
		return fmt.Errorf("list %s chains: %w", table, err)
	}
	var errs []error
	var ours []string
	for _, chain := range all {
		if isOwned(table, chain) {
			ours = append(ours, chain)
			continue
		}
		rules, err := c.List(table, chain)
		if err != nil {
			errs = append(errs, fmt.Errorf("list %s %s: %w", table, chain, err))
			continue
		}
		for _, r := range rules {
			body, ok := strings.CutPrefix(r, "-A "+chain+" ")
			if !ok || !ourJump(table, chain, body) {
				continue
			}
			if err := c.Delete(table, chain, splitRule(body)...); err != nil {
				errs = append(errs, fmt.Errorf("delete %s %s jump %q: %w", table, chain, body, err))
			}
		}
	}
	// Flush all before deleting any, so a chain that jumps to another is empty when that one goes.
	for _, chain := range ours {
		if err := c.ClearChain(table, chain); err != nil {
			errs = append(errs, fmt.Errorf("flush %s %s: %w", table, chain, err))
		}
	}
	for _, chain := range ours {
		if err := c.DeleteChain(table, chain); err != nil {
			errs = append(errs, fmt.Errorf("delete %s %s: %w", table, chain, err))
		}
	}
	return errors.Join(errs...)
}

// splitRule splits a rule body as `iptables -S` prints it into argv, honouring double-quoted
// words (comments).
func splitRule(s string) []string {
	var out []string
	var cur strings.Builder
	quoted, inWord := false, false
	for _, r := range s {
		switch {
		case r == '"':
			quoted, inWord = !quoted, true
		case r == ' ' && !quoted:
			if inWord {
				out = append(out, cur.String())
				cur.Reset()
			}
			inWord = false
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out
}
