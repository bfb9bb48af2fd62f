package transparent

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// fakeRunner keeps our mangle chain per family and the nft table in memory; a restore that
// mentions failRule fails as iptables-restore does on a kernel without xt_socket.
type fakeRunner struct {
	failRule string
	mangle   map[portal.Family]string
	nft      string
}

func (f *fakeRunner) Save(_ context.Context, fam portal.Family, table string) ([]byte, error) {
	return []byte("*mangle\n:PREROUTING ACCEPT [0:0]\n" + f.mangle[fam] + "COMMIT\n"), nil
}

func (f *fakeRunner) Restore(_ context.Context, fam portal.Family, data []byte) error {
	s := string(data)
	if f.failRule != "" && strings.Contains(s, f.failRule) {
		return &iptables.ExitError{Command: "iptables-restore", Code: 2, Stderr: "iptables-restore v1.8.9 (nf_tables): Couldn't load match `socket':No such file or directory"}
	}
	if strings.Contains(s, "-X "+Chain) {
		f.mangle[fam] = ""
		return nil
	}
	f.mangle[fam] = ":" + Chain + " - [0:0]\n-A PREROUTING " + jumpRule + "\n"
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, "-A "+Chain+" ") {
			f.mangle[fam] += l + "\n"
		}
	}
	return nil
}

func (f *fakeRunner) NFT(_ context.Context, stdin []byte, args ...string) ([]byte, error) {
	if stdin == nil {
		if f.nft == "" {
			return nil, &iptables.ExitError{Command: "nft", Code: 1, Stderr: "Error: No such file or directory"}
		}
		return []byte(f.nft), nil
	}
	if strings.Contains(string(stdin), "{") {
		f.nft = string(stdin)
	} else {
		f.nft = ""
	}
	return nil, nil
}

// fakeNetlink keeps rules, routes and fdb entries in memory.
type fakeNetlink struct {
	rules  map[portal.Family][]Rule
	routes map[portal.Family][]netip.Prefix
	fdb    bool
	// ports of the one bridge, cni0 (1 unless set: -1 means none).
	ports int
}

func (f *fakeNetlink) Rules(_ context.Context, fam portal.Family) ([]Rule, error) {
	return slices.Clone(f.rules[fam]), nil
}
func (f *fakeNetlink) AddRule(_ context.Context, fam portal.Family, r Rule) error {
	f.rules[fam] = append(f.rules[fam], r)
	return nil
}
func (f *fakeNetlink) DeleteRule(_ context.Context, fam portal.Family, r Rule) error {
	f.rules[fam] = slices.DeleteFunc(f.rules[fam], func(x Rule) bool { return x == r })
	return nil
}
func (f *fakeNetlink) LocalRoutes(_ context.Context, fam portal.Family, _ int) ([]netip.Prefix, error) {
	return slices.Clone(f.routes[fam]), nil
}
func (f *fakeNetlink) AddLocalRoute(_ context.Context, fam portal.Family, _ int, dst netip.Prefix) error {
	f.routes[fam] = append(f.routes[fam], dst)
	return nil
}
func (f *fakeNetlink) DeleteLocalRoute(_ context.Context, fam portal.Family, _ int, dst netip.Prefix) error {
	f.routes[fam] = slices.DeleteFunc(f.routes[fam], func(x netip.Prefix) bool { return x == dst })
	return nil
}
func (f *fakeNetlink) Bridges(context.Context, net.HardwareAddr) ([]Bridge, error) {
	ports := 1
	if f.ports != 0 {
		ports = max(f.ports, 0)
	}
	return []Bridge{{Name: "cni0", Index: 3, HasMAC: f.fdb, Ports: ports}}, nil
}
func (f *fakeNetlink) BridgesWithPorts(context.Context) ([]int, error) {
	if f.ports < 0 {
		return nil, nil
	}
	return []int{3}, nil
}
func (f *fakeNetlink) AddFDB(context.Context, int, net.HardwareAddr) error { f.fdb = true; return nil }
func (f *fakeNetlink) DeleteFDB(context.Context, int, net.HardwareAddr) error {
	f.fdb = false
	return nil
}
func (f *fakeNetlink) Sysctl(context.Context, string) (string, error) { return "1\n", nil }

func newFakes() (*fakeRunner, *fakeNetlink) {
	return &fakeRunner{mangle: map[portal.Family]string{}},
		&fakeNetlink{rules: map[portal.Family][]Rule{}, routes: map[portal.Family][]netip.Prefix{}}
}

// TestSyncUnsupportedLeavesNothing: a kernel without the socket match fails the probe with an
// error naming it, and nothing stays installed (the IPv4 family went in before IPv6 failed).
func TestSyncUnsupportedLeavesNothing(t *testing.T) {
	r, nl := newFakes()
	// IPv4 succeeds, IPv6 fails: what IPv4 installed must go again.
	fr := &familyFailRunner{fakeRunner: r, fail: portal.IPv6}
	n := New(Config{Runner: fr, Netlink: nl, Families: []portal.Family{portal.IPv4, portal.IPv6}})
	sup, err := n.Sync(t.Context())
	if err == nil || !strings.Contains(err.Error(), "socket match") || !strings.Contains(err.Error(), "IPv6") {
		t.Fatalf("Sync error = %v, want one naming the IPv6 socket match", err)
	}
	if sup.Socket || sup.PolicyRouting || sup.Bridge || sup.Reason != "no xt_socket" {
		t.Errorf("Support = %+v, want nothing, reason no xt_socket", sup)
	}
	if r.mangle[portal.IPv4] != "" || r.mangle[portal.IPv6] != "" || r.nft != "" || nl.fdb ||
		len(nl.rules[portal.IPv4])+len(nl.rules[portal.IPv6])+len(nl.routes[portal.IPv4])+len(nl.routes[portal.IPv6]) != 0 {
		t.Errorf("left installed: mangle %q, nft %q, fdb %v, rules %v, routes %v", r.mangle, r.nft, nl.fdb, nl.rules, nl.routes)
	}
	// Once supported, a later failure keeps what works in place (no flapping on a transient error).
	fr.fail = 0
	if _, err := n.Sync(t.Context()); err != nil {
		t.Fatal(err)
	}
	fr.fail = portal.IPv6
	r.mangle[portal.IPv6] = "" // someone removed it, and the repair fails
	if _, err := n.Sync(t.Context()); err == nil {
		t.Fatal("Sync with a failing repair: no error")
	}
	if r.mangle[portal.IPv4] == "" || len(nl.rules[portal.IPv4]) != 1 {
		t.Errorf("a failed repair after the probe removed the working IPv4 part: mangle %q rules %v", r.mangle, nl.rules)
	}
}

// familyFailRunner fails the socket match's restore of one family.
type familyFailRunner struct {
	*fakeRunner
	fail portal.Family
}

func (f *familyFailRunner) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	if fam == f.fail && strings.Contains(string(data), "-m socket") {
		f.failRule = "-m socket"
		defer func() { f.failRule = "" }()
	}
	return f.fakeRunner.Restore(ctx, fam, data)
}

// TestSyncNoBridgesWithPorts: a node whose only bridge has no port (bind mode's kube-portal0 on a
// kernel without dummy links) bridges no reply between its pods: NoBridges, whatever Bridge says.
func TestSyncNoBridgesWithPorts(t *testing.T) {
	for _, tc := range []struct {
		ports int
		want  bool
	}{{-1, true}, {2, false}} {
		r, nl := newFakes()
		nl.ports = tc.ports
		sup, err := New(Config{Runner: r, Netlink: nl, Families: []portal.Family{portal.IPv4}}).Sync(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if sup.NoBridges != tc.want {
			t.Errorf("a bridge with %d ports: NoBridges = %v, want %v", max(tc.ports, 0), sup.NoBridges, tc.want)
		}
	}
}

// TestInstalledSeesPolicyRouting: Installed says yes once a Sync put the rule and route of every
// family in place, and no when one is missing (a node never set up, or one a user cleaned).
func TestInstalledSeesPolicyRouting(t *testing.T) {
	r, nl := newFakes()
	n := New(Config{Runner: r, Netlink: nl, Families: []portal.Family{portal.IPv4, portal.IPv6}})
	if n.Installed(t.Context()) {
		t.Fatal("Installed on a bare node")
	}
	if _, err := n.Sync(t.Context()); err != nil {
		t.Fatal(err)
	}
	if !n.Installed(t.Context()) {
		t.Fatal("not Installed after a Sync")
	}
	nl.routes[portal.IPv6] = nil
	if n.Installed(t.Context()) {
		t.Error("Installed without the IPv6 local route")
	}
}

// TestBridgesChanged: a bridge that gains its first port after a Sync (cni0 with the first pod)
// is a change until the next Sync has seen it.
func TestBridgesChanged(t *testing.T) {
	r, nl := newFakes()
	nl.ports = -1 // no bridge with a port yet
	n := New(Config{Runner: r, Netlink: nl, Families: []portal.Family{portal.IPv4}})
	if _, err := n.Sync(t.Context()); err != nil {
		t.Fatal(err)
	}
	if n.BridgesChanged(t.Context()) {
		t.Fatal("changed right after a Sync")
	}
	nl.ports = 1
	if !n.BridgesChanged(t.Context()) {
		t.Fatal("a bridge that gained a port is not a change")
	}
	if _, err := n.Sync(t.Context()); err != nil {
		t.Fatal(err)
	}
	if n.BridgesChanged(t.Context()) {
		t.Error("still a change after the Sync that saw it")
	}
}
