package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: as in golden_test.go (node 192.168.1.10 / fd00:1::10, cluster IPs 10.96.0.0/16).

// manySpecs returns n TCP service ports with cluster IPs 10.96.x.y and proxy ports from base.
func manySpecs(n int, base uint16) []portal.Spec {
	specs := make([]portal.Spec, n)
	for i := range specs {
		specs[i] = portal.Spec{
			Name:       spn(fmt.Sprintf("ns%d", i), fmt.Sprintf("svc%d", i), "http"),
			Protocol:   service.TCP,
			Port:       80,
			ClusterIPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i / 250), byte(i%250 + 1)})},
			ProxyPort:  base + uint16(i),
		}
	}
	return specs
}

func mustSync(t *testing.T, p *Portals, specs []portal.Spec) {
	t.Helper()
	if err := p.Sync(t.Context(), specs); err != nil {
		t.Fatal(err)
	}
}

func freshDump(t *testing.T, cfg Config, specs []portal.Spec) string {
	t.Helper()
	fake := NewFake()
	mustSync(t, New(cfg, fake), specs)
	return fake.Dump()
}

func sortedLines(s string) string {
	lines := strings.Split(s, "\n")
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func TestSyncUnchangedRunsNothing(t *testing.T) {
	fake := NewFake()
	p := New(v4Config(), fake)
	mustSync(t, p, manySpecs(3, 34000))
	before := fake.Counts()
	mustSync(t, p, manySpecs(3, 34000))
	// Only the canary check of each table: no restore, no read-back.
	want := before
	want.Commands += 2
	if got := fake.Counts(); got != want {
		t.Errorf("second sync with no change: counts %+v, want %+v (two canary checks only)", got, want)
	}
}

func TestSyncRemovalLeavesNoTrace(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts = true
	fake := NewFake()
	p := New(cfg, fake)
	specs := manySpecs(5, 34000)
	specs[0].NodePort = 30080
	specs[1].ExternalIPs = addrs("203.0.113.7")
	mustSync(t, p, specs)
	mustSync(t, p, nil)
	if d := lineDiff(freshDump(t, cfg, nil), fake.Dump()); d != "" {
		t.Errorf("rules after removing every service (-want +got):\n%s", d)
	}
}

// TestSyncReplayInAnyOrder applies a shuffled history of service states and then one final state:
// the rules must be those of the final state alone (order within a chain may differ, since small
// changes append).
func TestSyncReplayInAnyOrder(t *testing.T) {
	cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}, ProtectProxyPorts: true}
	states := make([][]portal.Spec, 8)
	for i := range states {
		specs := manySpecs(20+i*3, 34000+uint16(i*7))
		for j := range specs {
			if (i+j)%3 == 0 {
				specs[j].NodePort = 30000 + uint16(j)
			}
			if (i+j)%5 == 0 {
				specs[j].ExternalIPs = addrs("203.0.113.7", "2001:db8::7")
			}
			if (i*j)%4 == 1 {
				specs[j].ClusterIPs = append(specs[j].ClusterIPs, netip.MustParseAddr(fmt.Sprintf("fd00:96::%x", j+1)))
			}
		}
		states[i] = specs
	}
	final := states[3]
	want := sortedLines(freshDump(t, cfg, final))
	for seed := range uint64(10) {
		t.Run(fmt.Sprintf("seed_%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 1))
			fake := NewFake()
			p := New(cfg, fake)
			for _, i := range rng.Perm(len(states)) {
				mustSync(t, p, states[i])
			}
			mustSync(t, p, final)
			if d := lineDiff(want, sortedLines(fake.Dump())); d != "" {
				t.Errorf("sorted rules after replay (-want +got):\n%s", d)
			}
		})
	}
}

// A small change is two nat transactions: the new rules go in at the head of their chains (cheap,
// and they win over the stale ones at once), then the stale rules are deleted (a delete makes
// iptables-nft read the whole chain).
func TestSyncSmallChangeIsIncremental(t *testing.T) {
	fake := NewFake()
	var nat []string
	fake.RestoreHook = func(_ portal.Family, data []byte) error {
		if bytes.HasPrefix(data, []byte("*nat")) {
			nat = append(nat, string(data))
		}
		return nil
	}
	p := New(v4Config(), fake)
	specs := manySpecs(500, 34000)
	mustSync(t, p, specs)
	nat = nil
	specs[42].ProxyPort = 40000
	mustSync(t, p, specs)
	want := []string{`*nat
-I KUBE-PORTALS-CONTAINER 1 -d 10.96.0.43/32 -p tcp -m comment --comment "ns42/svc42:http" -m tcp --dport 80 -j REDIRECT --to-ports 40000
-I KUBE-PORTALS-HOST 1 -d 10.96.0.43/32 -p tcp -m comment --comment "ns42/svc42:http" -m tcp --dport 80 -j DNAT --to-destination 192.168.1.10:40000
COMMIT
`, `*nat
-D KUBE-PORTALS-CONTAINER -d 10.96.0.43/32 -p tcp -m comment --comment "ns42/svc42:http" -m tcp --dport 80 -j REDIRECT --to-ports 34042
-D KUBE-PORTALS-HOST -d 10.96.0.43/32 -p tcp -m comment --comment "ns42/svc42:http" -m tcp --dport 80 -j DNAT --to-destination 192.168.1.10:34042
COMMIT
`}
	if len(nat) != len(want) {
		t.Fatalf("%d nat restores for one changed port, want %d (insert, then delete):\n%s", len(nat), len(want), strings.Join(nat, "\n"))
	}
	for i := range want {
		if d := lineDiff(want[i], nat[i]); d != "" {
			t.Errorf("nat restore %d for one changed port (-want +got):\n%s", i+1, d)
		}
	}
	// The believed state is what the kernel (fake) has, so the next sync with no change runs nothing.
	before := fake.Counts().Restores
	mustSync(t, p, specs)
	if got := fake.Counts().Restores - before; got != 0 {
		t.Errorf("%d restores after an unchanged sync, want 0", got)
	}
	if d := lineDiff(sortedLines(freshDump(t, v4Config(), specs)), sortedLines(fake.Dump())); d != "" {
		t.Errorf("rules (-want +got):\n%s", d)
	}
}

func TestSyncMassChangeRewritesChains(t *testing.T) {
	fake := NewFake()
	var last []byte
	fake.RestoreHook = func(_ portal.Family, data []byte) error { last = data; return nil }
	p := New(v4Config(), fake)
	mustSync(t, p, manySpecs(500, 34000))
	mustSync(t, p, manySpecs(500, 35000))
	if !bytes.Contains(last, []byte(":KUBE-PORTALS-CONTAINER - [0:0]\n")) || bytes.Contains(last, []byte("-D ")) {
		t.Errorf("restore after changing every proxy port: want a whole-chain rewrite without deletes, got:\n%.400s", last)
	}
	if d := lineDiff(freshDump(t, v4Config(), manySpecs(500, 35000)), fake.Dump()); d != "" {
		t.Errorf("rules (-want +got):\n%s", d)
	}
}

func TestSyncRepairsChangesMadeByOthers(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts = true
	specs := manySpecs(3, 34000)
	specs[0].NodePort = 30080
	want := freshDump(t, cfg, specs)
	// canarySees: the damage flushes or deletes one of our chains, which the canary check of the
	// very next (periodic) sync notices; other damage waits for the full read-back.
	tests := []struct {
		name       string
		damage     [][]string
		canarySees bool
	}{
		{"flushed_chain", [][]string{{"-t", "nat", "-F", ChainPortalsContainer}}, true},
		{"deleted_rule", [][]string{{"-t", "nat", "-D", ChainPortalsHost, "1"}}, false},
		{"deleted_jump", [][]string{{"-t", "nat", "-D", "PREROUTING", "1"}}, false},
		{"extra_rule", [][]string{{"-t", "nat", "-A", ChainPortalsHost, "-p", "tcp", "-j", "ACCEPT"}}, false},
		{"deleted_chain", [][]string{{"-t", "filter", "-D", "INPUT", "3"}, {"-t", "filter", "-F", ChainGuard}, {"-t", "filter", "-X", ChainGuard}}, true},
		// The guard (third in INPUT, after the firewall and reject jumps) must come before
		// KUBE-NODEPORT-NON-LOCAL, which accepts.
		{"jumps_reordered", [][]string{{"-t", "filter", "-D", "INPUT", "3"}, {"-t", "filter", "-A", "INPUT",
			"-m", "comment", "--comment", "new connections reach proxy ports only through a portal", "-j", ChainGuard}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
			cfg := cfg
			cfg.Clock = clk
			cfg.VerifyPeriod = time.Minute
			fake := NewFake()
			p := New(cfg, fake)
			mustSync(t, p, specs)
			for _, args := range tt.damage {
				if err := fake.Command(t.Context(), portal.IPv4, args...); err != nil {
					t.Fatalf("damage %v: %v", args, err)
				}
			}
			damaged := fake.Dump()
			mustSync(t, p, specs)
			if tt.canarySees {
				if d := lineDiff(want, fake.Dump()); d != "" {
					t.Errorf("rules after the next sync, its canary check failed (-want +got):\n%s", d)
				}
			} else if got := fake.Dump(); got != damaged {
				t.Errorf("sync before the verify period read back and changed the rules")
			}
			clk.SetTime(clk.Now().Add(time.Minute))
			mustSync(t, p, specs)
			if d := lineDiff(want, fake.Dump()); d != "" {
				t.Errorf("rules after the periodic read-back (-want +got):\n%s", d)
			}
			if got := p.Stats().Repairs; got != 1 {
				t.Errorf("Stats().Repairs = %d, want 1", got)
			}
		})
	}
}

func TestSyncFailedRestoreIsCountedAndRetried(t *testing.T) {
	fake := NewFake()
	fail := true
	fake.RestoreHook = func(portal.Family, []byte) error {
		if fail {
			return &ExitError{Command: "iptables-restore", Code: 4, Stderr: "Another app is currently holding the xtables lock"}
		}
		return nil
	}
	p := New(v4Config(), fake)
	err := p.Sync(t.Context(), manySpecs(2, 34000))
	var ee *ExitError
	if !errors.As(err, &ee) || ee.Code != 4 {
		t.Fatalf("Sync error = %v, want the restore's exit status 4", err)
	}
	if s := p.Stats(); s.Restores != 2 || s.RestoreFailures != 2 {
		t.Errorf("Stats() = %+v, want 2 restores (nat, filter), both failed", s)
	}
	fail = false
	mustSync(t, p, manySpecs(2, 34000))
	if d := lineDiff(freshDump(t, v4Config(), manySpecs(2, 34000)), fake.Dump()); d != "" {
		t.Errorf("rules after the retry (-want +got):\n%s", d)
	}
}

func TestSyncWithoutNATPointsToBindMode(t *testing.T) {
	fake := NewFake()
	fake.NoNAT = true
	err := New(v4Config(), fake).Sync(t.Context(), manySpecs(1, 34000))
	if !errors.Is(err, ErrNATUnavailable) || !strings.Contains(err.Error(), "--portal-mode=bind") {
		t.Errorf("Sync error = %v, want ErrNATUnavailable naming --portal-mode=bind", err)
	}
}

func TestSyncSkipsFamilyOnce(t *testing.T) {
	tests := []struct {
		name        string
		cfg         Config
		unavailable map[portal.Family]bool
		wantLog     string
	}{
		{"no_ip6tables", Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}}, map[portal.Family]bool{portal.IPv6: true}, "iptables binary not available"},
		{"no_ipv6_node_ip", v4Config(), nil, "the node has no IP address of this family"},
		{"bind_address_ipv4", Config{BindAddress: nodeV4}, nil, "bind address 192.168.1.10 is not of this family"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logger, hook := logtest.NewNullLogger()
			tt.cfg.Logger = logger
			fake := NewFake()
			fake.Unavailable = tt.unavailable
			p := New(tt.cfg, fake)
			specs := []portal.Spec{{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"), ProxyPort: 34001}}
			mustSync(t, p, specs)
			mustSync(t, p, specs)
			var got []string
			for _, e := range hook.AllEntries() {
				got = append(got, e.Message)
			}
			if len(got) != 1 || !strings.Contains(got[0], tt.wantLog) || hook.LastEntry().Data["family"] != "IPv6" {
				t.Errorf("log lines %q, want exactly one for IPv6 containing %q", got, tt.wantLog)
			}
			if strings.Contains(fake.Dump(), "# IPv6") || !strings.Contains(fake.Dump(), "10.96.0.10/32") {
				t.Errorf("want IPv4 rules only, got:\n%s", fake.Dump())
			}
		})
	}
}

func TestSyncSkipsInvalidSpec(t *testing.T) {
	logger, hook := logtest.NewNullLogger()
	cfg := v4Config()
	cfg.Logger = logger
	fake := NewFake()
	specs := []portal.Spec{webSpec(), {Name: spn("default", "sctp", ""), Protocol: service.SCTP, Port: 9, ClusterIPs: addrs("10.96.0.9"), ProxyPort: 34009}}
	p := New(cfg, fake)
	mustSync(t, p, specs)
	mustSync(t, p, specs)
	if d := lineDiff(freshDump(t, v4Config(), []portal.Spec{webSpec()}), fake.Dump()); d != "" {
		t.Errorf("rules (-want +got):\n%s", d)
	}
	var warnings []string
	for _, e := range hook.AllEntries() {
		if e.Level == logrus.WarnLevel {
			warnings = append(warnings, fmt.Sprint(e.Data[logrus.ErrorKey]))
		}
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "default/sctp") {
		t.Errorf("warnings %q, want exactly one, for default/sctp", warnings)
	}
}

func TestRestartSwapsRulesInOneRestorePerTable(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts = true
	fake := NewFake()
	mustSync(t, New(cfg, fake), manySpecs(300, 34000))
	var restores []string
	fake.RestoreHook = func(_ portal.Family, data []byte) error {
		restores = append(restores, strings.SplitN(string(data), "\n", 2)[0])
		return nil
	}
	// A restarted proxy has new proxy ports for every service; the old rules stay in force until
	// the one restore per table replaces them.
	mustSync(t, New(cfg, fake), manySpecs(300, 36000))
	// filter first: the new proxy ports are accepted and guarded before nat steers traffic to them.
	if !slices.Equal(restores, []string{"*filter", "*nat"}) {
		t.Errorf("restores on restart = %q, want one for filter, then one for nat", restores)
	}
	if d := lineDiff(freshDump(t, cfg, manySpecs(300, 36000)), fake.Dump()); d != "" {
		t.Errorf("rules after restart (-want +got):\n%s", d)
	}
}

func TestSwitchingProtectionOffRemovesGuard(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts = true
	fake := NewFake()
	mustSync(t, New(cfg, fake), manySpecs(3, 34000))
	cfg.ProtectProxyPorts = false
	mustSync(t, New(cfg, fake), manySpecs(3, 34000))
	if d := lineDiff(freshDump(t, cfg, manySpecs(3, 34000)), fake.Dump()); d != "" {
		t.Errorf("rules (-want +got):\n%s", d)
	}
}

func TestCleanup(t *testing.T) {
	dual := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}, ProtectProxyPorts: true}
	t.Run("removes_every_chain_and_jump", func(t *testing.T) {
		fake := NewFake()
		specs := manySpecs(3, 34000)
		specs[0].ClusterIPs = append(specs[0].ClusterIPs, netip.MustParseAddr("fd00:96::1"))
		mustSync(t, New(dual, fake), specs)
		// A foreign rule in a built-in chain survives.
		if err := fake.Command(t.Context(), portal.IPv4, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "-j", "ACCEPT"); err != nil {
			t.Fatal(err)
		}
		// Cleanup runs from a fresh process with a default config (--cleanup).
		if err := New(Config{}, fake).Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		if got := fake.Dump(); strings.Contains(got, "KUBE-") || !strings.Contains(got, "-A PREROUTING -p tcp -j ACCEPT") {
			t.Errorf("after Cleanup want no KUBE- chain or rule and the foreign rule kept, got:\n%s", got)
		}
	})
	t.Run("nothing_to_remove", func(t *testing.T) {
		fake := NewFake()
		if err := New(Config{}, fake).Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		if n := fake.Counts().Restores; n != 0 {
			t.Errorf("Cleanup with nothing there ran %d restores, want 0", n)
		}
	})
	t.Run("family_without_binaries", func(t *testing.T) {
		fake := NewFake()
		fake.Unavailable = map[portal.Family]bool{portal.IPv6: true}
		mustSync(t, New(v4Config(), fake), manySpecs(1, 34000))
		if err := New(Config{}, fake).Cleanup(t.Context()); err != nil {
			t.Fatal(err)
		}
		if got := fake.Dump(); got != "" {
			t.Errorf("after Cleanup got:\n%s", got)
		}
	})
}

func TestRulesAndStats(t *testing.T) {
	fake := NewFake()
	p := New(v4Config(), fake)
	mustSync(t, p, []portal.Spec{webSpec()})
	got := p.Rules()
	for _, want := range []string{
		"# IPv4\n*nat\n",
		`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 34001`,
		`-A INPUT -m comment --comment "Ensure that non-local NodePort traffic can flow" -j KUBE-NODEPORT-NON-LOCAL`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("Rules() lacks %q:\n%s", want, got)
		}
	}
	if s := p.Stats(); s.Rules != 2 || s.Restores != 2 || s.ReadBacks != 2 || s.RestoreFailures != 0 {
		t.Errorf("Stats() = %+v, want 2 rules, 2 restores, 2 read-backs", s)
	}
}

// orderRunner records the order of read-backs and restores.
type orderRunner struct {
	*Fake
	ops []string
}

func (r *orderRunner) Save(ctx context.Context, fam portal.Family, table string) ([]byte, error) {
	r.ops = append(r.ops, "save "+table)
	return r.Fake.Save(ctx, fam, table)
}

func (r *orderRunner) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	table, _, _ := strings.Cut(strings.TrimPrefix(string(data), "*"), "\n")
	r.ops = append(r.ops, "restore "+table)
	return r.Fake.Restore(ctx, fam, data)
}

// TestSyncReadsEveryTableBeforeRestoring checks the first sync's order: both read-backs while the
// tables hold none of our rules (cheap with iptables-nft), then filter before nat, so the guard
// and accept rules of a new proxy port are in before traffic is steered to it.
func TestSyncReadsEveryTableBeforeRestoring(t *testing.T) {
	r := &orderRunner{Fake: NewFake()}
	cfg := v4Config()
	cfg.ProtectProxyPorts = true
	mustSync(t, New(cfg, r), manySpecs(3, 20000))
	want := []string{"save filter", "save nat", "restore filter", "restore nat"}
	if diff := cmp.Diff(want, r.ops); diff != "" {
		t.Errorf("operations (-want +got):\n%s", diff)
	}
}

// TestAfterNATRepairSeesTheSpecs: the Sync that restores a nat table someone else flushed calls
// AfterNATRepair with its specs (the caller clears the conntrack entries left untranslated);
// an ordinary Sync, or a repair of the filter table only, does not.
func TestAfterNATRepairSeesTheSpecs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage []string
		want   bool
	}{
		{"nat_flushed", []string{"-t", "nat", "-F", ChainPortalsContainer}, true},
		{"filter_flushed", []string{"-t", "filter", "-F", ChainReject}, false},
		{"nothing", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got [][]portal.Spec
			cfg := v4Config()
			cfg.AfterNATRepair = func(_ context.Context, specs []portal.Spec) { got = append(got, specs) }
			fake := NewFake()
			p := New(cfg, fake)
			specs := manySpecs(2, 34000)
			specs[1].RejectInternal = true // its REJECT is in filter's KUBE-PORTALS-REJECT
			mustSync(t, p, specs)
			if len(got) != 0 {
				t.Fatalf("AfterNATRepair called by the first sync")
			}
			if tc.damage != nil {
				if err := fake.Command(t.Context(), portal.IPv4, tc.damage...); err != nil {
					t.Fatal(err)
				}
			}
			mustSync(t, p, specs)
			if called := len(got) == 1; called != tc.want {
				t.Fatalf("AfterNATRepair calls = %d, want called=%v", len(got), tc.want)
			}
			if tc.want && !slices.EqualFunc(got[0], specs, specEqual) {
				t.Errorf("AfterNATRepair specs = %+v, want %+v", got[0], specs)
			}
		})
	}
}
