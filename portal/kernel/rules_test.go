package kernel

import (
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: the seeds' own addresses for the seed cases (cluster IPs 10.254.0.0/16, endpoints
// 10.254.86.x, 172.16.18.124, 192.168.x); otherwise node 192.168.1.10 / fd00:1::10, cluster IPs
// 10.96.0.0/16 and fd00:96::/112, pods 10.244.0.0/16 (this node's endpoints 10.244.1.x, others
// 10.244.2.x), external IP 203.0.113.7, load-balancer IP 198.51.100.20.

var update = flag.Bool("update", false, "rewrite the golden files in testdata/kernel")

var (
	addrs = testenv.Addrs
	spn   = testenv.PortName
)

func eps(s ...string) []netip.AddrPort {
	var out []netip.AddrPort
	for _, e := range s {
		out = append(out, netip.MustParseAddrPort(e))
	}
	return out
}

func prefixes(s ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range s {
		out = append(out, netip.MustParsePrefix(p))
	}
	return out
}

var node = Config{NodeIPs: addrs("192.168.1.10", "fd00:1::10")}

var pods = Config{NodeIPs: addrs("192.168.1.10"), PodCIDRs: prefixes("10.244.0.0/16", "fd00:244::/64")}

// seed003 is the four-endpoint NodePort service of seed 003 (default/svc-1, 2222 → 22, node port 30022).
func seed003() portal.Spec {
	return portal.Spec{Name: spn("default", "svc-1", ""), Protocol: service.TCP, Port: 2222, NodePort: 30022,
		ClusterIPs: addrs("10.254.159.12"),
		Kernel: &portal.KernelPath{Cluster: eps("10.254.86.8:22", "10.254.86.2:22", "10.254.86.4:22", "10.254.86.3:22"),
			AnyEndpoints: true}}
}

// seed001 is default/kubernetes:https with ClientIP affinity (seed 001).
func seed001() portal.Spec {
	return portal.Spec{Name: spn("default", "kubernetes", "https"), Protocol: service.TCP, Port: 443,
		ClusterIPs: addrs("10.254.0.1"),
		Kernel:     &portal.KernelPath{Cluster: eps("172.16.18.124:6443"), AnyEndpoints: true, AffinitySeconds: 10800}}
}

// seed004 is the two-endpoint NodePort service of seed 004.
func seed004() portal.Spec {
	return portal.Spec{Name: spn("ns-dfbc21ef", "pool4-sc-site", "pool4-sc-site"), Protocol: service.TCP, Port: 20881,
		NodePort: 64264, ClusterIPs: addrs("10.254.59.218"),
		Kernel: &portal.KernelPath{Cluster: eps("192.168.75.114:20881", "192.168.181.42:20881"), AnyEndpoints: true}}
}

func web(k portal.KernelPath) portal.Spec {
	return portal.Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10"), ExternalIPs: addrs("203.0.113.7"), LoadBalancerIPs: addrs("198.51.100.20"), Kernel: &k}
}

var (
	remote = eps("10.244.2.5:8080", "10.244.2.6:8080")
	local  = eps("10.244.1.5:8080")
	all    = append(slices.Clone(local), remote...)
)

func TestGoldenKernelRules(t *testing.T) {
	withRanges := web(portal.KernelPath{Cluster: all, AnyEndpoints: true})
	withRanges.SourceRanges = prefixes("192.168.1.0/24", "203.0.113.0/25", "2001:db8::/32")
	tests := []struct {
		name  string
		cfg   Config
		fams  []portal.Family
		specs []portal.Spec
	}{
		{name: "empty", cfg: node},
		{name: "seed003_four_endpoints", cfg: Config{}, specs: []portal.Spec{seed003()}},
		{name: "seed001_affinity", cfg: Config{}, specs: []portal.Spec{seed001()}},
		{name: "seed004_node_port", cfg: Config{}, specs: []portal.Spec{seed004()}},
		{name: "every_traffic_kind", cfg: node, specs: []portal.Spec{web(portal.KernelPath{Cluster: all, AnyEndpoints: true})}},
		{name: "pod_cidr_masquerade", cfg: pods, specs: []portal.Spec{web(portal.KernelPath{Cluster: all, AnyEndpoints: true})}},
		{name: "no_endpoints_reject", cfg: node, specs: []portal.Spec{
			web(portal.KernelPath{}),
			{Name: spn("kube-system", "dns", "dns"), Protocol: service.UDP, Port: 53, ClusterIPs: addrs("10.96.0.53"), Kernel: &portal.KernelPath{}},
		}},
		{name: "external_local", cfg: pods, specs: []portal.Spec{
			web(portal.KernelPath{Cluster: all, Local: local, ExternalLocal: true, AnyEndpoints: true})}},
		{name: "external_local_none_on_node_drops", cfg: pods, specs: []portal.Spec{
			web(portal.KernelPath{Cluster: remote, ExternalLocal: true, AnyEndpoints: true})}},
		{name: "internal_local", cfg: pods, specs: []portal.Spec{
			{Name: spn("default", "cache", ""), Protocol: service.TCP, Port: 6379, ClusterIPs: addrs("10.96.0.20"),
				Kernel: &portal.KernelPath{Local: local, InternalLocal: true, AnyEndpoints: true}}}},
		{name: "internal_local_none_on_node_drops", cfg: pods, specs: []portal.Spec{
			{Name: spn("default", "cache", ""), Protocol: service.TCP, Port: 6379, ClusterIPs: addrs("10.96.0.20"),
				Kernel: &portal.KernelPath{InternalLocal: true, AnyEndpoints: true}}}},
		{name: "load_balancer_source_ranges", cfg: node, specs: []portal.Spec{withRanges}},
		{name: "udp_affinity", cfg: node, specs: []portal.Spec{
			{Name: spn("kube-system", "dns", "dns"), Protocol: service.UDP, Port: 53, ClusterIPs: addrs("10.96.0.53"),
				Kernel: &portal.KernelPath{Cluster: eps("10.244.1.7:53", "10.244.2.7:53"), AnyEndpoints: true, AffinitySeconds: 60}}}},
		{name: "ipv6", cfg: pods, fams: []portal.Family{portal.IPv6}, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
				ClusterIPs: addrs("10.96.0.10", "fd00:96::10"),
				Kernel: &portal.KernelPath{Cluster: eps("10.244.1.5:8080", "[fd00:244::5]:8080", "[fd00:244::6]:8080"),
					AnyEndpoints: true, AffinitySeconds: 300}}}},
		{name: "node_port_addresses", cfg: Config{NodePortAddresses: prefixes("192.168.1.0/24", "10.0.0.1/8")},
			specs: []portal.Spec{seed004()}},
		{name: "conntrack_liberal_keeps_invalid", cfg: Config{ConntrackTCPLiberal: true}, specs: []portal.Spec{seed001()}},
		{name: "portal_specs_skipped", cfg: node, specs: []portal.Spec{
			{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fams := tt.fams
			if fams == nil {
				fams = []portal.Family{portal.IPv4}
			}
			var got strings.Builder
			for _, fam := range fams {
				got.WriteString("# " + fam.String() + "\n")
				got.WriteString(Render(Build(tt.cfg, fam, tt.specs), true))
			}
			checkGolden(t, tt.name, got.String())
		})
	}
}

// TestSeedRulesReproduced checks the seeds' own iptables-save lines word for word.
func TestSeedRulesReproduced(t *testing.T) {
	tests := []struct {
		name string
		spec portal.Spec
		want []string // "CHAIN body" lines that must all be in the nat table
	}{
		{name: "seed001_affinity", spec: seed001(), want: []string{
			`KUBE-SVC-NPX46M4PTMTKRN6Y -m comment --comment "default/kubernetes:https" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-FOCF455PUHPZHEKG --mask 255.255.255.255 --rsource -j KUBE-SEP-FOCF455PUHPZHEKG`,
			`KUBE-SEP-FOCF455PUHPZHEKG -p tcp -m comment --comment "default/kubernetes:https" -m recent --set --name KUBE-SEP-FOCF455PUHPZHEKG --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 172.16.18.124:6443`,
		}},
		{name: "seed004_cluster_ip_and_spread", spec: seed004(), want: []string{
			`KUBE-SEP-RRSJPMBBE7GG2XAM -s 192.168.75.114/32 -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site" -j KUBE-MARK-MASQ`,
			`KUBE-SEP-RRSJPMBBE7GG2XAM -p tcp -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site" -m tcp -j DNAT --to-destination 192.168.75.114:20881`,
			`KUBE-SEP-WVYWW757ZWPZ7HKT -s 192.168.181.42/32 -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site" -j KUBE-MARK-MASQ`,
			`KUBE-SEP-WVYWW757ZWPZ7HKT -p tcp -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site" -m tcp -j DNAT --to-destination 192.168.181.42:20881`,
			`KUBE-SERVICES -d 10.254.59.218/32 -p tcp -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site cluster IP" -m tcp --dport 20881 -j KUBE-SVC-SATU2HUKOORIDRPW`,
			`KUBE-SVC-SATU2HUKOORIDRPW -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-WVYWW757ZWPZ7HKT`,
			`KUBE-SVC-SATU2HUKOORIDRPW -m comment --comment "ns-dfbc21ef/pool4-sc-site:pool4-sc-site" -j KUBE-SEP-RRSJPMBBE7GG2XAM`,
			// The seed's KUBE-NODEPORTS jumped to KUBE-MARK-MASQ and KUBE-SVC itself; kube-proxy
			// since 1.24 goes through KUBE-EXT, which masquerades and then jumps to KUBE-SVC.
			`KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000`,
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			nat := Build(Config{}, portal.IPv4, []portal.Spec{tt.spec})[TableNAT]
			for _, w := range tt.want {
				chain, body, _ := strings.Cut(w, " ")
				if !slices.Contains(nat[chain], body) {
					t.Errorf("missing -A %s %s\nchain has:\n%s", chain, body, strings.Join(nat[chain], "\n"))
				}
			}
		})
	}
}

// TestSeedChainNames reproduces every chain name of the seeds from the text kube-proxy hashed.
// Seed 003 comes from a kube-proxy that named an unnamed port "default/svc-1:" (with the colon);
// today's, like ServicePortName.String, says "default/svc-1", so the golden file of that seed has
// other names, and this test hashes the seed's text directly.
func TestSeedChainNames(t *testing.T) {
	tests := []struct{ text, want string }{
		{"default/kubernetes:https" + "tcp", "NPX46M4PTMTKRN6Y"},                                    // seed 001, 003
		{"default/kubernetes:https" + "tcp" + "172.16.18.124:6443", "FOCF455PUHPZHEKG"},             // seed 001
		{"default/kubernetes:https" + "tcp" + "192.168.6.110:6443", "2LNK4QUGPB2C5PDO"},             // seed 003
		{"default/svc-1:" + "tcp", "D25WXD2YSOVKEUTU"},                                              // seed 003
		{"default/svc-1:" + "tcp" + "10.254.86.2:22", "CLKUH4WMQ3CNBJ7K"},                           // seed 003
		{"default/svc-1:" + "tcp" + "10.254.86.3:22", "F4EJGNTAH3JOOQC6"},                           // seed 003
		{"default/svc-1:" + "tcp" + "10.254.86.4:22", "BCYRFQ26LZTOSSU7"},                           // seed 003
		{"default/svc-1:" + "tcp" + "10.254.86.8:22", "D3FORTYMXA7BVSDA"},                           // seed 003
		{"default/svc-lonely:" + "tcp", "E6FDK4HG4F4JSB77"},                                         // seed 003
		{"ns-dfbc21ef/pool4-sc-site:pool4-sc-site" + "tcp", "SATU2HUKOORIDRPW"},                     // seed 004
		{"ns-dfbc21ef/pool4-sc-site:pool4-sc-site" + "tcp192.168.75.114:20881", "RRSJPMBBE7GG2XAM"}, // seed 004
	}
	for _, tt := range tests {
		if got := hash(tt.text); got != tt.want {
			t.Errorf("hash(%q) = %s, want %s", tt.text, got, tt.want)
		}
	}
	if got := ServiceChain(PrefixService, spn("default", "kubernetes", "https"), service.TCP); got != "KUBE-SVC-NPX46M4PTMTKRN6Y" {
		t.Errorf("ServiceChain(default/kubernetes:https) = %s", got)
	}
}

// TestProbability: rule i of n matches 1/(n-i) of what reaches it, printed as iptables-save does.
func TestProbability(t *testing.T) {
	tests := []struct {
		n    int
		want string
	}{
		{2, "0.50000000000"}, {3, "0.33333333349"}, {4, "0.25000000000"}, {5, "0.20000000019"}, {10, "0.10000000009"},
	}
	for _, tt := range tests {
		if got := Probability(tt.n); got != tt.want {
			t.Errorf("Probability(%d) = %s, want %s", tt.n, got, tt.want)
		}
	}
	// Seed 003 lists 0.25000000000, 0.33332999982, 0.50000000000: the read-back of the five-digit
	// probabilities an older kube-proxy wrote.
	for given, want := range map[string]string{"0.25000": "0.25000000000", "0.33333": "0.33332999982", "0.50000": "0.50000000000"} {
		if got := SavedProbability(given); got != want {
			t.Errorf("SavedProbability(%s) = %s, want %s (seed 003)", given, got, want)
		}
	}
}

func TestIsServiceChain(t *testing.T) {
	for chain, want := range map[string]bool{
		"KUBE-SVC-NPX46M4PTMTKRN6Y": true, "KUBE-SEP-FOCF455PUHPZHEKG": true, "KUBE-FW-X": true, "KUBE-EXT-X": true,
		"KUBE-SVL-X": true, "KUBE-SERVICES": false, "KUBE-PORTALS-HOST": false, "KUBE-MARK-MASQ": false,
	} {
		if got := IsServiceChain(TableNAT, chain); got != want {
			t.Errorf("IsServiceChain(nat, %s) = %v, want %v", chain, got, want)
		}
	}
	if IsServiceChain(TableFilter, "KUBE-SVC-NPX46M4PTMTKRN6Y") {
		t.Error("a filter chain is never a per-port chain")
	}
}

func checkGolden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("..", "..", "testdata", "kernel", name+".golden")
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./portal/kernel/ -update to create it)", err)
	}
	if string(want) != got {
		t.Errorf("%s mismatch:\n--- want\n%s\n--- got\n%s", path, want, got)
	}
}

// TestNoRandomFully: without --random-fully support the MASQUERADE rule goes without it.
func TestNoRandomFully(t *testing.T) {
	for _, tt := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, `-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully`},
		{Config{NoRandomFully: true}, `-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE`},
	} {
		rules := Build(tt.cfg, portal.IPv4, nil)[TableNAT][ChainPostrouting]
		if rules[len(rules)-1] != tt.want {
			t.Errorf("NoRandomFully=%v: last KUBE-POSTROUTING rule %q, want %q", tt.cfg.NoRandomFully, rules[len(rules)-1], tt.want)
		}
	}
}
