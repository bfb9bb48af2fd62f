package iptables

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: as golden_test.go; endpoints 10.244.1.5:8080 (this node) and 10.244.2.5:8080.

func kernelCfg() Config {
	return Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: nodeV4}, KernelPath: true,
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}
}

func onKernel(s portal.Spec) portal.Spec {
	s.ProxyPort = 0
	s.Kernel = &portal.KernelPath{Cluster: []netip.AddrPort{netip.MustParseAddrPort("10.244.1.5:8080"),
		netip.MustParseAddrPort("10.244.2.5:8080")}, AnyEndpoints: true}
	return s
}

func dnsSpec() portal.Spec {
	return portal.Spec{Name: spn("kube-system", "kube-dns", "dns"), Protocol: service.UDP, Port: 53,
		ClusterIPs: addrs("10.96.0.53"), ProxyPort: 34002}
}

// TestGoldenKernelPath: a port on the kernel path beside one on the proxy path, in the same tables.
func TestGoldenKernelPath(t *testing.T) {
	fake := NewFake()
	p := New(kernelCfg(), fake)
	if err := p.Sync(t.Context(), []portal.Spec{onKernel(webSpec()), dnsSpec()}); err != nil {
		t.Fatal(err)
	}
	checkGolden(t, "kernel_path_beside_portals", fake.Dump())
}

// TestKernelPathSwitch moves a port between the paths and back: each switch is one sync whose
// restores leave exactly the new path's rules for the port, and the other port untouched.
func TestKernelPathSwitch(t *testing.T) {
	fake := NewFake()
	p := New(kernelCfg(), fake)
	proxyPath := []portal.Spec{webSpec(), dnsSpec()}
	kernelPath := []portal.Spec{onKernel(webSpec()), dnsSpec()}
	mustSync(t, p, proxyPath)
	onProxy := fake.Dump()

	steps := []struct {
		name       string
		specs      []portal.Spec
		want, gone []string
	}{
		{name: "proxy_to_kernel", specs: kernelPath,
			want: []string{`-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-`,
				"-j DNAT --to-destination 10.244.2.5:8080", "--dport 53 -j REDIRECT --to-ports 34002"},
			gone: []string{"--to-ports 34001", "34001"}},
		{name: "kernel_to_proxy", specs: proxyPath,
			want: []string{"--dport 80 -j REDIRECT --to-ports 34001", "--dport 53 -j REDIRECT --to-ports 34002"},
			gone: []string{"KUBE-SVC-", "KUBE-SEP-", "10.244.2.5"}},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			before := fake.Counts().Restores
			mustSync(t, p, st.specs)
			// filter and nat: an apply each, and at most a cleanup each.
			if n := fake.Counts().Restores - before; n < 1 || n > 4 {
				t.Errorf("switch took %d restores, want 1 to 4 (apply and cleanup per table)", n)
			}
			dump := fake.Dump()
			for _, w := range st.want {
				if !strings.Contains(dump, w) {
					t.Errorf("missing %q in:\n%s", w, dump)
				}
			}
			for _, g := range st.gone {
				if strings.Contains(dump, g) {
					t.Errorf("%q still there:\n%s", g, dump)
				}
			}
			assertReadBackMatches(t, p, fake)
		})
	}
	if got := fake.Dump(); got != onProxy {
		t.Errorf("back on the proxy path the tables differ from before (-want +got):\n%s", lineDiff(onProxy, got))
	}
}

// assertReadBackMatches checks that what Sync believes is live is what the tables hold.
func assertReadBackMatches(t *testing.T, p *Portals, fake *Fake) {
	t.Helper()
	for _, table := range tables {
		data, err := fake.Save(t.Context(), portal.IPv4, table)
		if err != nil {
			t.Fatal(err)
		}
		st, err := parseSave(table, data)
		if err != nil {
			t.Fatal(err)
		}
		if live := p.live[portal.IPv4][table]; !live.equal(st) {
			t.Errorf("%s: believed live state differs from the table:\nbelieved:\n%s\ntable:\n%s", table, render(table, live), render(table, st))
		}
	}
}

// TestKernelPathEndpointChange rewrites the spread whole: the probabilities of every rule change.
func TestKernelPathEndpointChange(t *testing.T) {
	fake := NewFake()
	p := New(kernelCfg(), fake)
	s := onKernel(webSpec())
	mustSync(t, p, []portal.Spec{s})
	s = onKernel(webSpec())
	s.Kernel.Cluster = append(s.Kernel.Cluster, netip.MustParseAddrPort("10.244.3.5:8080"))
	mustSync(t, p, []portal.Spec{s})
	dump := fake.Dump()
	var spread []string
	for _, l := range strings.Split(dump, "\n") {
		if strings.HasPrefix(l, "-A KUBE-SVC-") && !strings.Contains(l, "KUBE-MARK-MASQ") && !strings.Contains(l, ChainCanary) {
			spread = append(spread, l)
		}
	}
	if len(spread) != 3 || !strings.Contains(spread[0], "0.33333333349") || !strings.Contains(spread[1], "0.50000000000") ||
		strings.Contains(spread[2], "probability") {
		t.Errorf("spread over three endpoints:\n%s", strings.Join(spread, "\n"))
	}
	assertReadBackMatches(t, p, fake)
	mustSync(t, p, nil)
	if d := fake.Dump(); strings.Contains(d, "KUBE-SEP-") || strings.Contains(d, "KUBE-SVC-") {
		t.Errorf("chains of a removed port left:\n%s", d)
	}
}

// TestKernelPathOffSkipsKernelSpecs: a node without the kernel path (no KernelPath) programs no
// kernel chains and reports the spec.
func TestKernelPathOffSkipsKernelSpecs(t *testing.T) {
	fake := NewFake()
	p := New(v4Config(), fake)
	if err := p.Sync(t.Context(), []portal.Spec{onKernel(webSpec())}); err != nil {
		t.Fatal(err)
	}
	if d := fake.Dump(); strings.Contains(d, "KUBE-SERVICES") || strings.Contains(d, "10.96.0.10") {
		t.Errorf("kernel path off, yet:\n%s", d)
	}
}

// TestKernelPathCleanup: --cleanup removes the kernel path's chains and jumps with the portals'.
func TestKernelPathCleanup(t *testing.T) {
	fake := NewFake()
	p := New(kernelCfg(), fake)
	mustSync(t, p, []portal.Spec{onKernel(webSpec()), dnsSpec()})
	if err := p.Cleanup(t.Context()); err != nil {
		t.Fatal(err)
	}
	if d := fake.Dump(); d != "" {
		t.Errorf("after Cleanup:\n%s", d)
	}
}

// TestKernelPathTakesOverKubeProxyLeftovers: chains a kube-proxy in iptables mode left behind
// (its jump, KUBE-SERVICES, a KUBE-SVC and a KUBE-SEP chain) are ours by name: the first sync
// replaces KUBE-SERVICES and removes the per-port chains it no longer wants; the jump, identical
// to ours, stays once.
func TestKernelPathTakesOverKubeProxyLeftovers(t *testing.T) {
	fake := NewFake()
	leftovers := `*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-NPX46M4PTMTKRN6Y - [0:0]
:KUBE-SEP-FOCF455PUHPZHEKG - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-SEP-FOCF455PUHPZHEKG -p tcp -m comment --comment "default/kubernetes:https" -m tcp -j DNAT --to-destination 172.16.18.124:6443
-A KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment "default/kubernetes:https" -j KUBE-SEP-FOCF455PUHPZHEKG
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m comment --comment "default/kubernetes:https cluster IP" -m tcp --dport 443 -j KUBE-SVC-NPX46M4PTMTKRN6Y
COMMIT
`
	if err := fake.Restore(t.Context(), portal.IPv4, []byte(leftovers)); err != nil {
		t.Fatal(err)
	}
	p := New(kernelCfg(), fake)
	mustSync(t, p, []portal.Spec{dnsSpec()})
	dump := fake.Dump()
	for _, gone := range []string{"KUBE-SVC-NPX46M4PTMTKRN6Y", "KUBE-SEP-FOCF455PUHPZHEKG", "10.96.0.1/32"} {
		if strings.Contains(dump, gone) {
			t.Errorf("kube-proxy's %s is still there:\n%s", gone, dump)
		}
	}
	if n := strings.Count(dump, `-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`); n != 1 {
		t.Errorf("the PREROUTING jump to KUBE-SERVICES is there %d times, want once:\n%s", n, dump)
	}
	assertReadBackMatches(t, p, fake)
}

// TestHasRandomFully: the probe is one restore that leaves nothing behind; a failing restore
// means no support.
func TestHasRandomFully(t *testing.T) {
	fake := NewFake()
	if !HasRandomFully(t.Context(), fake, portal.IPv4) || fake.Dump() != "" {
		t.Errorf("probe on a working fake: want true and nothing left, got dump:\n%s", fake.Dump())
	}
	fake.RestoreHook = func(portal.Family, []byte) error {
		return &ExitError{Command: "iptables-restore", Code: 2, Stderr: "unknown option \"--random-fully\""}
	}
	if HasRandomFully(t.Context(), fake, portal.IPv4) {
		t.Error("probe whose restore fails: want false")
	}
}
