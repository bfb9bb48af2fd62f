package iptables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The tables we write to.
const (
	tableNAT    = "nat"
	tableFilter = "filter"
)

// The legacy chain names (kube-proxy userspace), plus the guard chain that is new here.
const (
	ChainPortalsContainer  = "KUBE-PORTALS-CONTAINER"
	ChainPortalsHost       = "KUBE-PORTALS-HOST"
	ChainNodePortContainer = "KUBE-NODEPORT-CONTAINER"
	ChainNodePortHost      = "KUBE-NODEPORT-HOST"
	ChainNodePortNonLocal  = "KUBE-NODEPORT-NON-LOCAL"
	ChainGuard             = "KUBE-PORTALS-GUARD"
)

// tables lists the tables in the order they are programmed. The filter table comes first: its
// rules accept (KUBE-NODEPORT-NON-LOCAL) and guard (KUBE-PORTALS-GUARD) the proxy ports, so they
// must be in place for a new proxy port before the nat table starts steering traffic to it (after a
// restart every proxy port is new). Cleanup goes the other way: see natFirst.
var tables = []string{tableFilter, tableNAT}

// natFirst is the order Cleanup removes tables in (stop steering before dropping the rules that
// accept the steered traffic) and the order Rules shows them in (portals first, as people read them).
var natFirst = []string{tableNAT, tableFilter}

// ownedChains are the chains we create, per table, in the order they are declared. Cleanup and
// read-back recognise all of them, also the guard chain when protection is switched off, so
// switching it off removes it.
var ownedChains = map[string][]string{
	tableNAT:    {ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost},
	tableFilter: {ChainNodePortNonLocal, ChainGuard},
}

func isOwned(table, chain string) bool { return slices.Contains(ownedChains[table], chain) }

// jump is one rule in a built-in chain that sends packets into one of our chains.
type jump struct {
	table, chain string
	// head jumps are inserted at position 1, the others appended (legacy -I / -A).
	head bool
	body string
}

// Jump rules, exactly as legacy iptablesInit wrote them (iptables-save spelling).
var (
	jumpPortalsContainer = jump{tableNAT, "PREROUTING", true,
		`-m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j ` + ChainPortalsContainer}
	jumpPortalsHost = jump{tableNAT, "OUTPUT", true,
		`-m comment --comment "handle ClusterIPs; NOTE: this must be before the NodePort rules" -j ` + ChainPortalsHost}
	jumpNodePortContainer = jump{tableNAT, "PREROUTING", false,
		`-m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain" -j ` + ChainNodePortContainer}
	jumpNodePortHost = jump{tableNAT, "OUTPUT", false,
		`-m addrtype --dst-type LOCAL -m comment --comment "handle service NodePorts; NOTE: this must be the last rule in the chain" -j ` + ChainNodePortHost}
	jumpNodePortNonLocal = jump{tableFilter, "INPUT", true,
		`-m comment --comment "Ensure that non-local NodePort traffic can flow" -j ` + ChainNodePortNonLocal}
	// The guard must see packets before KUBE-NODEPORT-NON-LOCAL accepts them, so it comes first.
	jumpGuard = jump{tableFilter, "INPUT", true,
		`-m comment --comment "new connections reach proxy ports only through a portal" -j ` + ChainGuard}
)

// wantedJumps are the jump rules in the order they must appear in their built-in chains.
func wantedJumps(protect bool) []jump {
	js := []jump{jumpPortalsContainer, jumpNodePortContainer, jumpPortalsHost, jumpNodePortHost}
	if protect {
		js = append(js, jumpGuard)
	}
	return append(js, jumpNodePortNonLocal)
}

// tableState is the content of our part of one table: our chains with their rule bodies (the text
// after "-A CHAIN ") in order, and the jump rules into them found in other chains, in order. It
// describes both the wanted state and what is believed to be live.
type tableState struct {
	chains map[string][]string
	jumps  map[string][]string
}

func newTableState() *tableState {
	return &tableState{chains: map[string][]string{}, jumps: map[string][]string{}}
}

func (t *tableState) equal(o *tableState) bool {
	eq := func(a, b []string) bool { return slices.Equal(a, b) }
	return maps2Equal(t.chains, o.chains, eq) && maps2Equal(t.jumps, o.jumps, eq)
}

func maps2Equal(a, b map[string][]string, eq func(a, b []string) bool) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		w, ok := b[k]
		if !ok || !eq(v, w) {
			return false
		}
	}
	return true
}

func (t *tableState) rules() int {
	n := 0
	for _, r := range t.chains {
		n += len(r)
	}
	return n
}

// familyRules is the wanted state of one family, per table.
type familyRules map[string]*tableState

// ruleBuilder turns specs into rules for one family.
type ruleBuilder struct {
	fam     portal.Family
	bind    netip.Addr // unspecified or a specific address of fam
	hostIP  netip.Addr
	npDsts  []string // "-d" values for node port rules; "" means no -d (all local addresses)
	protect bool
	out     familyRules

	// The parts of the current spec's rules that do not depend on the portal, built once per spec:
	// at 10,000 service ports the rule text is most of a sync's CPU.
	match     string // "-p tcp -m comment --comment \"ns/name:port\" -m tcp --dport "
	container string // containerTarget
	host      string // hostTarget
}

// buildRules is the pure function from specs to the wanted rules of one family. Specs come sorted
// by portal.CompareSpecs (Sync sorts them once for both families), and each spec's rules in the legacy order (cluster IP, external IPs, load-balancer
// IPs, node port), so the text is stable. Invalid specs are returned for the caller to report.
func buildRules(cfg Config, fam portal.Family, specs []portal.Spec) (familyRules, []error) {
	b := ruleBuilder{fam: fam, bind: cfg.BindAddress, hostIP: cfg.HostIPs[fam], protect: cfg.ProtectProxyPorts,
		out: familyRules{}}
	for _, table := range tables {
		b.out[table] = newTableState()
		for _, c := range ownedChains[table] {
			if c == ChainGuard && !b.protect {
				continue
			}
			b.out[table].chains[c] = nil
		}
	}
	for _, j := range wantedJumps(b.protect) {
		t := b.out[j.table]
		t.jumps[j.chain] = append(t.jumps[j.chain], j.body)
	}
	if len(cfg.NodePortAddresses) == 0 {
		b.npDsts = []string{""}
	}
	for _, p := range cfg.NodePortAddresses {
		if portal.FamilyOf(p.Addr()) == fam {
			b.npDsts = append(b.npDsts, p.Masked().String())
		}
	}

	var errs []error
	for i := range specs {
		if err := validate(&specs[i]); err != nil {
			errs = append(errs, err)
			continue
		}
		b.add(&specs[i])
	}
	return b.out, errs
}

func validate(s *portal.Spec) error {
	switch {
	case s.Protocol != service.TCP && s.Protocol != service.UDP:
		return fmt.Errorf("portal %s: protocol %q is not supported", s.Name, s.Protocol)
	case s.Port == 0:
		return fmt.Errorf("portal %s: service port is 0", s.Name)
	case s.ProxyPort == 0:
		return fmt.Errorf("portal %s: proxy port is 0", s.Name)
	}
	return nil
}

func (b *ruleBuilder) add(s *portal.Spec) {
	b.match = specMatch(s)
	b.container, b.host = b.containerTarget(s), b.hostTarget(s)
	for _, ip := range b.ofFamily(s.ClusterIPs) {
		b.internalPortal(s, ip)
	}
	for _, ip := range b.ofFamily(s.ExternalIPs) {
		b.externalPortal(s, ip)
	}
	for _, ip := range b.ofFamily(s.LoadBalancerIPs) {
		b.internalPortal(s, ip)
	}
	if s.NodePort != 0 && len(b.npDsts) > 0 {
		for _, d := range b.npDsts {
			b.rule(tableNAT, ChainNodePortContainer, b.common(d, s.NodePort), b.container)
			b.rule(tableNAT, ChainNodePortHost, b.common(d, s.NodePort), b.host)
		}
		// Legacy: accept new connections to the proxy port (the node port after translation).
		b.rule(tableFilter, ChainNodePortNonLocal, b.common("", s.ProxyPort), "-m state --state NEW -j ACCEPT")
	}
	if b.protect {
		b.rule(tableFilter, ChainGuard, "! -i lo "+b.common("", s.ProxyPort),
			"-m conntrack --ctstate NEW -m conntrack ! --ctstate DNAT -j DROP")
	}
}

// internalPortal is the portal of a cluster IP or load-balancer IP: any packet to it is steered.
func (b *ruleBuilder) internalPortal(s *portal.Spec, ip netip.Addr) {
	d := hostPrefix(ip)
	b.rule(tableNAT, ChainPortalsContainer, b.common(d, s.Port), b.container)
	b.rule(tableNAT, ChainPortalsHost, b.common(d, s.Port), b.host)
}

// externalPortal is the portal of an external IP: pods reach it through the proxy only when the
// packet did not come in on a bridge port or the IP is local; the host only when the IP is local.
func (b *ruleBuilder) externalPortal(s *portal.Spec, ip netip.Addr) {
	d := hostPrefix(ip)
	b.rule(tableNAT, ChainPortalsContainer, b.common(d, s.Port)+" -m physdev ! --physdev-is-in", b.container)
	b.rule(tableNAT, ChainPortalsContainer, b.common(d, s.Port)+" -m addrtype --dst-type LOCAL", b.container)
	b.rule(tableNAT, ChainPortalsHost, b.common(d, s.Port)+" -m addrtype --dst-type LOCAL", b.host)
}

func (b *ruleBuilder) rule(table, chain, match, target string) {
	t := b.out[table]
	t.chains[chain] = append(t.chains[chain], match+" "+target)
}

// containerTarget: REDIRECT goes to the primary address of the incoming interface, so replies
// leave the way the request came and un-NAT correctly (DNAT to the node IP from a bridge would
// answer from the wrong address). A specific bind address is the only place the socket listens.
func (b *ruleBuilder) containerTarget(s *portal.Spec) string {
	if b.bind.IsUnspecified() {
		return "-j REDIRECT --to-ports " + strconv.Itoa(int(s.ProxyPort))
	}
	return "-j DNAT --to-destination " + netip.AddrPortFrom(b.bind, s.ProxyPort).String()
}

// hostTarget: REDIRECT of locally generated packets goes to 127.0.0.1 while replies come from the
// node IP, so host traffic is DNATed to a non-loopback node address instead.
func (b *ruleBuilder) hostTarget(s *portal.Spec) string {
	ip := b.hostIP
	if !b.bind.IsUnspecified() {
		ip = b.bind
	}
	return "-j DNAT --to-destination " + netip.AddrPortFrom(ip, s.ProxyPort).String()
}

func (b *ruleBuilder) ofFamily(ips []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if ip.IsValid() && portal.FamilyOf(ip) == b.fam {
			out = append(out, ip.Unmap())
		}
	}
	return out
}

func hostPrefix(ip netip.Addr) string {
	return netip.PrefixFrom(ip, ip.BitLen()).String()
}

// common is legacy iptablesCommonPortalArgs in the order iptables-save prints it: the address and
// protocol first, then the comment and port match modules in the order they were given.
func (b *ruleBuilder) common(dst string, dport uint16) string {
	buf := make([]byte, 0, len("-d  ")+len(dst)+len(b.match)+5)
	if dst != "" {
		buf = append(append(append(buf, "-d "...), dst...), ' ')
	}
	buf = append(buf, b.match...)
	return string(strconv.AppendUint(buf, uint64(dport), 10))
}

// specMatch is the part of common that depends on the spec alone, up to the port number.
func specMatch(s *portal.Spec) string {
	proto := strings.ToLower(string(s.Protocol))
	buf := make([]byte, 0, 64)
	buf = append(append(append(buf, "-p "...), proto...), " -m comment --comment "...)
	buf = strconv.AppendQuote(buf, s.Name.String())
	buf = append(append(append(buf, " -m "...), proto...), " --dport "...)
	return string(buf)
}
