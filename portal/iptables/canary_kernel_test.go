package iptables

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// TestKernelCanaryRepairsFlushes: in a throwaway namespace with real iptables, a flush of any one
// of our chains, of a whole table, or a firewall-reload-like wipe (flush and delete every chain)
// is repaired by the very next periodic Sync (nothing changed, the verify period far off): its
// canary check fails and it reads back. Address plan: as in TestKernelRules (node 10.100.0.1).
func TestKernelCanaryRepairsFlushes(t *testing.T) {
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: labNodeV4}, ProtectProxyPorts: true,
		Clock: clk, VerifyPeriod: time.Hour}
	specs := []portal.Spec{
		{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
			ClusterIPs: addrs("10.96.0.10"), LoadBalancerIPs: addrs("198.51.100.20"), SourceRanges: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
			ProxyPort: 34001},
		{Name: spn("default", "empty", "http"), Protocol: service.TCP, Port: 80, ClusterIPs: addrs("10.96.0.11"),
			ProxyPort: 34002, RejectInternal: true},
	}
	p := New(cfg, &ExecRunner{Prefix: node.CommandPrefix()})
	mustSync(t, p, specs)
	want := strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n")

	type damage struct {
		name string
		cmds [][]string
	}
	var cases []damage
	for _, table := range []string{tableNAT, tableFilter} {
		for _, chain := range ownedChains[table] {
			cases = append(cases, damage{"flush_" + table + "_" + chain, [][]string{{"-t", table, "-F", chain}}})
		}
		cases = append(cases,
			damage{"flush_table_" + table, [][]string{{"-t", table, "-F"}}},
			damage{"wipe_table_" + table, [][]string{{"-t", table, "-F"}, {"-t", table, "-X"}}})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, c := range tc.cmds {
				node.MustExec(t, append([]string{"iptables", "-w", "5"}, c...)...)
			}
			repairedByNextSync(t, p, node, specs, want, fmt.Sprintf("the damage %v", tc.cmds))
		})
	}
}

// TestKernelCanaryRepairsKernelPathFlushes: with the kernel path on, a flush of any one of its
// chains (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-MARK-MASQ, KUBE-POSTROUTING, a KUBE-SVC-*, a
// KUBE-SEP-*, every other one of nat and filter) in a throwaway namespace is repaired by the very
// next periodic Sync, as the portals' chains are: the canary check sees the flush, not only the
// full read-back a VerifyPeriod later. Address plan: as in TestKernelRules (node 10.100.0.1);
// cluster IPs 10.96.0.20-21, load-balancer IP 198.51.100.21, endpoints 10.244.1.5/10.244.2.5:8080.
func TestKernelCanaryRepairsKernelPathFlushes(t *testing.T) {
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: labNodeV4}, ProtectProxyPorts: true,
		KernelPath: true, PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")},
		Clock: clk, VerifyPeriod: time.Hour}
	eps := []netip.AddrPort{netip.MustParseAddrPort("10.244.1.5:8080"), netip.MustParseAddrPort("10.244.2.5:8080")}
	specs := []portal.Spec{
		{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
			ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001},
		// Cluster IP, node port and a load-balancer IP with source ranges: KUBE-SVC, KUBE-SEP,
		// KUBE-EXT, KUBE-FW, KUBE-NODEPORTS and KUBE-PROXY-FIREWALL all have rules.
		{Name: spn("default", "fast", "http"), Protocol: service.TCP, Port: 80, NodePort: 30081,
			ClusterIPs: addrs("10.96.0.20"), LoadBalancerIPs: addrs("198.51.100.21"),
			SourceRanges: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
			Kernel:       &portal.KernelPath{Cluster: eps, AnyEndpoints: true}},
		// No endpoints: refused in filter's KUBE-SERVICES and KUBE-EXTERNAL-SERVICES.
		{Name: spn("default", "none", "dns"), Protocol: service.UDP, Port: 53, NodePort: 30053,
			ClusterIPs: addrs("10.96.0.21"), Kernel: &portal.KernelPath{}},
	}
	slices.SortFunc(specs, portal.CompareSpecs)
	p := New(cfg, &ExecRunner{Prefix: node.CommandPrefix()})
	mustSync(t, p, specs)
	want := strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n")

	// chain "" flushes the whole table; wipe also deletes every chain (a firewall reload).
	type flush struct {
		table, chain string
		wipe         bool
	}
	cases := []flush{{tableNAT, "", false}, {tableNAT, "", true}, {tableFilter, "", false}, {tableFilter, "", true}}
	for _, table := range []string{tableNAT, tableFilter} {
		for c := range p.live[portal.IPv4][table].chains {
			if isKernelChain(table, c) {
				cases = append(cases, flush{table: table, chain: c})
			}
		}
	}
	slices.SortFunc(cases, func(a, b flush) int { return strings.Compare(a.table+a.chain, b.table+b.chain) })
	for _, must := range []string{"nat/KUBE-SERVICES", "nat/KUBE-NODEPORTS", "nat/KUBE-MARK-MASQ", "nat/KUBE-POSTROUTING",
		"nat/KUBE-SVC-", "nat/KUBE-SEP-", "nat/KUBE-EXT-", "nat/KUBE-FW-", "filter/KUBE-SERVICES", "filter/KUBE-EXTERNAL-SERVICES",
		"filter/KUBE-FORWARD", "filter/KUBE-PROXY-FIREWALL"} {
		if !slices.ContainsFunc(cases, func(f flush) bool { return strings.HasPrefix(f.table+"/"+f.chain, must) }) {
			t.Fatalf("no kernel-path chain %s* among the programmed ones %v", must, cases)
		}
	}
	for _, tc := range cases {
		name := tc.table + "_" + tc.chain
		switch {
		case tc.wipe:
			name = "wipe_table_" + tc.table
		case tc.chain == "":
			name = "flush_table_" + tc.table
		}
		t.Run(name, func(t *testing.T) {
			flush := []string{"iptables", "-w", "5", "-t", tc.table, "-F"}
			if tc.chain != "" {
				flush = append(flush, tc.chain)
			}
			node.MustExec(t, flush...)
			if tc.wipe {
				node.MustExec(t, "iptables", "-w", "5", "-t", tc.table, "-X")
			}
			repairedByNextSync(t, p, node, specs, want, name)
		})
	}
}

// repairedByNextSync checks that damage to the node's rules (what names it) changed them, and
// that the next periodic sync (the same specs, the full read-back not due) puts back want and
// counts a repair: the canary check saw it.
func repairedByNextSync(t *testing.T, p *Portals, node *netns.NS, specs []portal.Spec, want, what string) {
	t.Helper()
	if got := strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n"); got == want {
		t.Fatalf("%s changed nothing", what)
	}
	before := p.Stats()
	mustSync(t, p, specs)
	if d := lineDiff(want, strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n")); d != "" {
		t.Errorf("rules after the next periodic sync (-want +got):\n%s", d)
	}
	if got := p.Stats(); got.Repairs <= before.Repairs {
		t.Errorf("Stats().Repairs = %d, was %d: want the sync to have repaired", got.Repairs, before.Repairs)
	}
}
