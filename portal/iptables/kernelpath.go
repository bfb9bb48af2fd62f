package iptables

import (
	"context"
	"fmt"
	"slices"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The kernel data path (portal/kernel) shares the portals' tables, read-back and restores: its
// chains are ours too, so one iptables-restore per table and sync carries both, and a port that
// switches path changes in one transaction per table. What differs is that its per-port chains
// have hashed names (so the set of owned chains is open), their rule order matters, and chains
// jump to each other.

// isKernelChain reports whether a chain belongs to the kernel path: a top-level chain or a
// per-port one.
func isKernelChain(table, chain string) bool {
	return slices.Contains(kernel.TopChains[table], chain) || kernel.IsServiceChain(table, chain)
}

// kernelJumps are the kernel path's jump rules, all inserted at the head of their chains as
// kube-proxy inserts them.
func kernelJumps() []jump {
	out := make([]jump, 0, len(kernel.Jumps))
	for _, j := range kernel.Jumps {
		out = append(out, jump{table: j.Table, chain: j.Chain, head: true, body: j.Body})
	}
	return out
}

// builtin reports whether a chain is one of the table's built-in chains. Jumps into the kernel
// path's top-level chains are recognised there only: other software (kubelet, CNI plugins) may
// jump to KUBE-MARK-MASQ from chains of its own, and those rules are not ours to remove.
func builtin(chain string) bool {
	switch chain {
	case "PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING":
		return true
	}
	return false
}

// ourJump reports whether a rule in chain with this body is one of our jump rules.
func ourJump(table, chain, body string) bool {
	target := jumpTarget(body)
	if isKernelChain(table, target) {
		return builtin(chain)
	}
	return isOwned(table, target)
}

// addKernel adds the kernel path's chains and jumps of one family to the wanted rules.
func (b *ruleBuilder) addKernel(cfg Config, specs []portal.Spec) {
	kcfg := kernel.Config{PodCIDRs: cfg.PodCIDRs, NodePortAddresses: cfg.NodePortAddresses, ConntrackTCPLiberal: cfg.ConntrackTCPLiberal,
		NoRandomFully: cfg.NoRandomFully}
	for _, ip := range cfg.HostIPs {
		kcfg.NodeIPs = append(kcfg.NodeIPs, ip)
	}
	for table, chains := range kernel.Build(kcfg, b.fam, specs) {
		t := b.out[table]
		for c, rules := range chains {
			t.chains[c] = rules
		}
	}
	// Head jumps come before the appended ones (the portals' node-port jumps) in the live chain.
	for _, j := range kernelJumps() {
		t := b.out[j.table]
		js := t.jumps[j.chain]
		i := 0
		for i < len(js) && jumpHead[js[i]] {
			i++
		}
		t.jumps[j.chain] = slices.Insert(js, i, j.body)
	}
}

// validateKernel checks a kernel-path spec: it needs no proxy port.
func validateKernel(s *portal.Spec) error {
	switch {
	case s.Protocol != service.TCP && s.Protocol != service.UDP:
		return fmt.Errorf("kernel path %s: protocol %q is not supported", s.Name, s.Protocol)
	case s.Port == 0:
		return fmt.Errorf("kernel path %s: service port is 0", s.Name)
	}
	return nil
}

// chainOrder lists the chains of a table that either state has: the fixed ones in declaration
// order, then the kernel path's per-port chains by name.
func chainOrder(table string, states ...*tableState) []string {
	out := slices.Clone(ownedChains[table])
	out = append(out, kernel.TopChains[table]...)
	var dyn []string
	for _, st := range states {
		for c := range st.chains {
			if kernel.IsServiceChain(table, c) {
				dyn = append(dyn, c)
			}
		}
	}
	slices.Sort(dyn)
	return append(out, slices.Compact(dyn)...)
}

// randomFullyProbe adds a MASQUERADE --random-fully rule to a scratch chain and removes it again.
const randomFullyProbe = `*nat
:KUBE-PORTALS-PROBE - [0:0]
-A KUBE-PORTALS-PROBE -j MASQUERADE --random-fully
-F KUBE-PORTALS-PROBE
-X KUBE-PORTALS-PROBE
COMMIT
`

// HasRandomFully tells whether fam's iptables and kernel take MASQUERADE --random-fully (iptables
// 1.6.2 and Linux 3.13 on), with one iptables-restore that leaves nothing behind. Call it at
// start-up; without it, Config.NoRandomFully keeps the kernel path's restores working.
func HasRandomFully(ctx context.Context, runner Runner, fam portal.Family) bool {
	return runner.Restore(ctx, fam, []byte(randomFullyProbe)) == nil
}
