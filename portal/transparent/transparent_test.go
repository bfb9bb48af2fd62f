package transparent

import (
	"context"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// fakeRunner keeps our two nft tables in memory, each transaction applied whole or not at all. It
// fails as nft does on a node without the binary (noNFT), without the socket expression
// (noSocket: nft_socket not built) or without the bridge family (noBridge).
type fakeRunner struct {
	noNFT, noSocket, noBridge bool
	// tables by family ("inet", "bridge"): the body as written.
	tables map[string]string
	writes int
}

func (f *fakeRunner) NFT(_ context.Context, stdin []byte, args ...string) ([]byte, error) {
	if f.noNFT {
		return nil, fmt.Errorf("nft: %w", iptables.ErrUnavailable)
	}
	if stdin == nil {
		switch {
		case slices.Equal(args, []string{"list", "tables"}):
			var out strings.Builder
			for _, fam := range slices.Sorted(maps.Keys(f.tables)) {
				fmt.Fprintf(&out, "table %s %s\n", fam, NFTTable)
			}
			return []byte(out.String()), nil
		case len(args) == 4 && args[0] == "list" && args[1] == "table":
			if t, ok := f.tables[args[2]]; ok {
				return []byte(t), nil
			}
			return nil, &iptables.ExitError{Command: "nft", Code: 1, Stderr: "Error: No such file or directory"}
		}
		return nil, fmt.Errorf("fake nft: unexpected %q", args)
	}
	s := string(stdin)
	f.writes++
	switch {
	case f.noSocket && strings.Contains(s, "socket transparent"):
		return nil, &iptables.ExitError{Command: "nft", Code: 1, Stderr: "Error: Could not process rule: No such file or directory"}
	case f.noBridge && strings.Contains(s, "table bridge"):
		return nil, &iptables.ExitError{Command: "nft", Code: 1, Stderr: "Error: Could not process rule: Operation not supported"}
	}
	next := maps.Clone(f.tables)
	for _, fam := range []string{"inet", "bridge"} {
		if strings.Contains(s, "delete table "+fam+" ") {
			delete(next, fam)
		}
		head := "table " + fam + " " + NFTTable + " {\n"
		if i := strings.Index(s, head); i >= 0 {
			body := s[i:]
			next[fam] = body[:strings.Index(body, "\n}\n")+3]
		}
	}
	f.tables = next
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
	return &fakeRunner{tables: map[string]string{}},
		&fakeNetlink{rules: map[portal.Family][]Rule{}, routes: map[portal.Family][]netip.Prefix{}}
}

func (f *fakeNetlink) empty() bool {
	return !f.fdb && len(f.rules[portal.IPv4])+len(f.rules[portal.IPv6])+len(f.routes[portal.IPv4])+len(f.routes[portal.IPv6]) == 0
}

// TestSyncUnsupportedLeavesNothing: a node without nft, or whose nft lacks the socket expression,
// fails the probe with an error naming it, and nothing stays installed (policy routing went in
// after the reply mark failed).
func TestSyncUnsupportedLeavesNothing(t *testing.T) {
	for _, tc := range []struct {
		name, reason string
		set          func(*fakeRunner)
	}{
		{"no_nft", "no nft", func(r *fakeRunner) { r.noNFT = true }},
		{"no_socket_expression", "no nft socket expression", func(r *fakeRunner) { r.noSocket = true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, nl := newFakes()
			tc.set(r)
			n := New(Config{Runner: r, Netlink: nl})
			sup, err := n.Sync(t.Context())
			if err == nil || !strings.Contains(err.Error(), "reply mark (nft table inet "+NFTTable+")") {
				t.Fatalf("Sync error = %v, want one naming the reply mark", err)
			}
			if sup.Socket || sup.PolicyRouting || sup.Bridge || sup.Reason != tc.reason {
				t.Errorf("Support = %+v, want nothing, reason %q", sup, tc.reason)
			}
			if len(r.tables) != 0 || !nl.empty() {
				t.Errorf("left installed: nft %q, fdb %v, rules %v, routes %v", r.tables, nl.fdb, nl.rules, nl.routes)
			}
		})
	}
	t.Run("failed_repair_after_the_probe_keeps_the_rest", func(t *testing.T) {
		r, nl := newFakes()
		n := New(Config{Runner: r, Netlink: nl})
		if _, err := n.Sync(t.Context()); err != nil {
			t.Fatal(err)
		}
		// Someone removed the inet table, and the repair fails: what works stays (no flapping
		// on a transient error).
		delete(r.tables, "inet")
		r.noSocket = true
		if _, err := n.Sync(t.Context()); err == nil {
			t.Fatal("Sync with a failing repair: no error")
		}
		if r.tables["bridge"] == "" || len(nl.rules[portal.IPv4]) != 1 || !nl.fdb {
			t.Errorf("a failed repair after the probe removed working parts: nft %q rules %v fdb %v", r.tables, nl.rules, nl.fdb)
		}
	})
}

// TestSyncBothTablesInOneWrite: the first Sync writes both tables in one nft transaction, and a
// Sync with nothing changed writes nothing; one missing table is written back.
func TestSyncBothTablesInOneWrite(t *testing.T) {
	r, nl := newFakes()
	n := New(Config{Runner: r, Netlink: nl})
	sup, err := n.Sync(t.Context())
	if err != nil || !sup.Socket || !sup.Bridge || sup.Reason != "" {
		t.Fatalf("Sync = %+v, %v; want all", sup, err)
	}
	if r.writes != 1 || r.tables["inet"] == "" || r.tables["bridge"] == "" {
		t.Fatalf("after the first Sync: %d writes, tables %q; want both tables in one", r.writes, r.tables)
	}
	if _, err := n.Sync(t.Context()); err != nil || r.writes != 1 {
		t.Errorf("unchanged Sync: %v, %d writes in all, want none more", err, r.writes)
	}
	for _, fam := range []string{"inet", "bridge"} {
		want := r.tables[fam]
		r.tables[fam] = strings.Replace(want, "accept;\n", "accept;\n}\n", 1) // someone changed it
		if _, err := n.Sync(t.Context()); err != nil || r.tables[fam] != want {
			t.Errorf("after a changed %s table, Sync (%v) left %q, want %q", fam, err, r.tables[fam], want)
		}
	}
}

// TestSyncNoBridgeFamily: without the nft bridge family the reply mark goes in alone, the mode
// works for what is not bridged, Support says why, and later Syncs do not try again.
func TestSyncNoBridgeFamily(t *testing.T) {
	r, nl := newFakes()
	r.noBridge = true
	n := New(Config{Runner: r, Netlink: nl})
	sup, err := n.Sync(t.Context())
	if err != nil || !sup.Socket || !sup.PolicyRouting || sup.Bridge || sup.Reason != "no nft bridge family" {
		t.Fatalf("Sync = %+v, %v; want the mark and policy routing, no bridge", sup, err)
	}
	if r.tables["inet"] == "" || r.tables["bridge"] != "" {
		t.Errorf("tables %q, want the inet one only", r.tables)
	}
	writes := r.writes
	if sup, err := n.Sync(t.Context()); err != nil || r.writes != writes || sup.Reason != "no nft bridge family" {
		t.Errorf("second Sync: %+v, %v, %d writes, want none", sup, err, r.writes-writes)
	}
}

// TestSyncOneFamily: with one family configured the mark is restricted to it.
func TestSyncOneFamily(t *testing.T) {
	for _, tc := range []struct {
		fams []portal.Family
		want string
	}{
		{[]portal.Family{portal.IPv4}, "meta nfproto ipv4 ct direction reply"},
		{[]portal.Family{portal.IPv4}, "meta nfproto ipv4 ct state new socket transparent 1"},
		{[]portal.Family{portal.IPv6}, "meta nfproto ipv6 ct direction reply"},
		{nil, "\t\tct state new socket transparent 1 ct mark set ct mark | 0x00100000\n"},
		{nil, "\t\tct direction reply ct mark & 0x00100000 == 0x00100000 meta mark set meta mark | 0x00100000\n"},
	} {
		r, nl := newFakes()
		if _, err := New(Config{Runner: r, Netlink: nl, Families: tc.fams}).Sync(t.Context()); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(r.tables["inet"], tc.want) {
			t.Errorf("families %v: inet table\n%s\nwant %q", tc.fams, r.tables["inet"], tc.want)
		}
	}
}

// legacyFake is a fakeRunner with iptables' mangle table of both families (what Save shows).
type legacyFake struct {
	*fakeRunner
	mangle map[portal.Family]string
}

func (f *legacyFake) Save(_ context.Context, fam portal.Family, _ string) ([]byte, error) {
	return []byte("*mangle\n:PREROUTING ACCEPT [0:0]\n" + f.mangle[fam] + "COMMIT\n"), nil
}

func (f *legacyFake) Restore(_ context.Context, fam portal.Family, data []byte) error {
	var kept []string
	for _, l := range strings.Split(f.mangle[fam], "\n") {
		if l != "" && !strings.Contains(string(data), "-D "+strings.TrimPrefix(l, "-A ")) &&
			!(strings.Contains(string(data), "-X "+LegacyChain) && strings.Contains(l, LegacyChain+" ")) {
			kept = append(kept, l+"\n")
		}
	}
	f.mangle[fam] = strings.Join(kept, "")
	return nil
}

// TestCleanupRemovesTheLegacyChain: Cleanup removes both nft tables, and the iptables chain of an
// earlier build with its jumps in both families, leaving others' rules.
func TestCleanupRemovesTheLegacyChain(t *testing.T) {
	r, nl := newFakes()
	other := "-A PREROUTING -j KUBE-KUBELET-CANARY\n"
	legacy := ":" + LegacyChain + " - [0:0]\n-A PREROUTING -j " + LegacyChain + "\n-A " + LegacyChain + " -j MARK --set-xmark 0x100000/0x100000\n"
	lf := &legacyFake{fakeRunner: r, mangle: map[portal.Family]string{portal.IPv4: other + legacy, portal.IPv6: legacy}}
	n := New(Config{Runner: lf, Netlink: nl})
	if _, err := n.Sync(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := n.Cleanup(t.Context()); err != nil {
		t.Fatal(err)
	}
	if lf.mangle[portal.IPv4] != other || lf.mangle[portal.IPv6] != "" {
		t.Errorf("mangle after Cleanup: %q, want only %q in IPv4", lf.mangle, other)
	}
	if len(r.tables) != 0 || !nl.empty() {
		t.Errorf("left installed: nft %q, fdb %v, rules %v, routes %v", r.tables, nl.fdb, nl.rules, nl.routes)
	}
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
