package iptables

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// saveOnly is a Runner for the read-back alone: Save returns what the fuzzer made of each
// family's iptables-save output, and anything that would change the rules fails the test.
type saveOnly struct {
	t    *testing.T
	save map[portal.Family][]byte
}

func (r saveOnly) Save(_ context.Context, fam portal.Family, _ string) ([]byte, error) {
	return r.save[fam], nil
}

func (r saveOnly) Restore(context.Context, portal.Family, []byte) error {
	r.t.Fatal("reading the rules back ran iptables-restore")
	return nil
}

func (r saveOnly) Command(context.Context, portal.Family, ...string) error {
	r.t.Fatal("reading the rules back ran iptables")
	return nil
}

func (r saveOnly) Chains(context.Context, portal.Family) (Chains, error) {
	r.t.Fatal("reading the rules back listed chains")
	return nil, nil
}

// goldenSaves are the golden dumps of testdata/portal, one per family: real rule sets to start
// from.
func goldenSaves(f *testing.F) [][2][]byte {
	files, err := filepath.Glob(filepath.Join(goldenDir, "*.golden"))
	if err != nil || len(files) == 0 {
		f.Fatalf("no golden files in %s: %v", goldenDir, err)
	}
	var out [][2][]byte
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		v4, v6, _ := strings.Cut(string(data), "# IPv6\n")
		out = append(out, [2][]byte{[]byte(v4), []byte(v6)})
	}
	return out
}

// FuzzReadSteered feeds the restart's read-back (iptables-save -t nat of both families) what a
// node may hold: our rules, someone else's, rules edited by hand, truncated output. It must not
// panic or change anything, and every service port it reports must be one a restarted process
// can reopen: a name, TCP or UDP, a proxy port, families, each port once and in name order.
// Reading back what the reader itself keeps of a table (render) must read the same.
func FuzzReadSteered(f *testing.F) {
	for _, g := range goldenSaves(f) {
		f.Add(g[0], g[1])
	}
	f.Add([]byte("*nat\n:KUBE-PORTALS-HOST - [0:0]\n-A KUBE-PORTALS-HOST -d 10.96.0.1/32 -p tcp -m comment --comment \"a/b:c\" -m tcp --dport 80 -j DNAT --to-destination \nCOMMIT\n"), []byte{})
	f.Add([]byte("*nat\n-A KUBE-PORTALS-CONTAINER -p udp -m comment --comment \"a/b\" -j REDIRECT --to-ports 65535\n"), []byte("*nat\n-A KUBE-NODEPORT-HOST -p tcp --comment \"x/y:z\" -j DNAT --to-destination [::1]:1\n"))
	f.Fuzz(func(t *testing.T, v4, v6 []byte) {
		run := saveOnly{t: t, save: map[portal.Family][]byte{portal.IPv4: v4, portal.IPv6: v6}}
		cfg := Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4, portal.IPv6: nodeV6}}
		got, err := New(cfg, run).ReadSteered(t.Context())
		if err != nil && !strings.Contains(err.Error(), "nat") {
			t.Fatalf("ReadSteered error %q does not say which table", err)
		}
		for i, s := range got {
			switch {
			case s.Name.Namespace == "" || s.Name.Name == "":
				t.Fatalf("steered port without a name: %+v", s)
			case s.Protocol != service.TCP && s.Protocol != service.UDP:
				t.Fatalf("steered port with protocol %q: %+v", s.Protocol, s)
			case s.ProxyPort == 0:
				t.Fatalf("steered port without a proxy port: %+v", s)
			case len(s.Families) == 0 || !slices.IsSorted(s.Families) || len(slices.Compact(slices.Clone(s.Families))) != len(s.Families):
				t.Fatalf("steered port families %v: want a sorted set", s.Families)
			case i > 0 && got[i-1].Name.String() >= s.Name.String():
				t.Fatalf("steered ports out of order or twice: %v then %v", got[i-1].Name, s.Name)
			}
		}
		for _, data := range [][]byte{v4, v6} {
			st, err := parseSave(tableNAT, data)
			if err != nil {
				continue
			}
			again, err := parseSave(tableNAT, []byte(render(tableNAT, st)))
			if err != nil {
				t.Fatalf("the reader's own rendering does not read back: %v", err)
			}
			if !again.equal(st) {
				t.Fatalf("read, rendered and read again differs:\n%s\nthen\n%s", render(tableNAT, st), render(tableNAT, again))
			}
		}
	})
}

// FuzzParseRule reads one portal rule body: whatever it holds, a rule is either not ours or
// names a service port with TCP or UDP and a proxy port.
func FuzzParseRule(f *testing.F) {
	f.Add(`-d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 34001`)
	f.Add(`-d fd00:96::10/128 -p udp -m comment --comment "ns/dns" -m udp --dport 53 -j DNAT --to-destination [fd00:100::1]:34002`)
	f.Add(`-p tcp -m comment --comment "a/b" -j DNAT --to-destination `)
	f.Add(`-p tcp -m comment --comment "a/b" -j REDIRECT --to-ports 0`)
	f.Fuzz(func(t *testing.T, body string) {
		r, ok := parseRule(body)
		if !ok {
			return
		}
		if r.name.Namespace == "" || r.name.Name == "" || (r.proto != service.TCP && r.proto != service.UDP) || r.port == 0 {
			t.Fatalf("parseRule(%q) = %+v", body, r)
		}
	})
}
