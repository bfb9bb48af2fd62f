package iptables

import (
	"net/netip"
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
			if got := strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n"); got == want {
				t.Fatalf("the damage %v changed nothing", tc.cmds)
			}
			before := p.Stats()
			mustSync(t, p, specs) // the periodic sync: same specs, verify period not due
			if d := lineDiff(want, strings.Join(kubeLines(kernelSave(t, node, portal.IPv4)), "\n")); d != "" {
				t.Errorf("rules after the next periodic sync (-want +got):\n%s", d)
			}
			if got := p.Stats(); got.Repairs <= before.Repairs {
				t.Errorf("Stats().Repairs = %d, was %d: want the sync to have repaired", got.Repairs, before.Repairs)
			}
		})
	}
}
