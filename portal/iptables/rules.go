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
	// ChainFirewall drops new connections to load-balancer IPs from clients outside the service's
	// loadBalancerSourceRanges (the allowed ones were translated in nat, so they no longer match).
	ChainFirewall = "KUBE-PORTALS-FIREWALL"
	// ChainReject refuses new connections to portals of service ports that have no endpoint for
	// that traffic (kube-proxy's "has no endpoints" REJECT rules).
	ChainReject = "KUBE-PORTALS-REJECT"
	// ChainCanary is in both tables, and every other chain of ours ends with a jump to it (it
	// returns at once). The kernel counts those references, and `iptables -n -L` shows the count
	// for the price of reading this one small chain, however many rules the others hold: a flush
	// of any of our chains, or of the table, or its deletion, changes it (see canary.go).
	ChainCanary = "KUBE-PORTALS-CANARY"
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
	tableNAT:    {ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost, ChainCanary},
	tableFilter: {ChainNodePortNonLocal, ChainGuard, ChainFirewall, ChainReject, ChainCanary},
}

func isOwned(table, chain string) bool {
	return slices.Contains(ownedChains[table], chain) || isKernelChain(table, chain)
}

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

// Filter-table jumps that see new connections whose destination is still a portal: in INPUT
// (node ports, local external IPs), FORWARD (cluster IPs from pods, routed through the node) and
// OUTPUT (the node's own connections). Traffic a portal translated no longer matches them. The
// firewall comes first, so a client outside the source ranges is dropped, not refused.
const (
	jumpFirewallBody = `-m conntrack --ctstate NEW -m comment --comment "load-balancer source ranges" -j ` + ChainFirewall
	jumpRejectBody   = `-m conntrack --ctstate NEW -m comment --comment "service ports without endpoints" -j ` + ChainReject
)

func filterJumps(chain string) []jump {
	return []jump{{tableFilter, chain, true, jumpFirewallBody}, {tableFilter, chain, true, jumpRejectBody}}
}

// wantedJumps are the jump rules in the order they must appear in their built-in chains (the
// kernel path's, when on, are added by addKernel).
func wantedJumps(protect bool) []jump {
	js := []jump{jumpPortalsContainer, jumpNodePortContainer, jumpPortalsHost, jumpNodePortHost}
	for _, chain := range []string{"INPUT", "FORWARD", "OUTPUT"} {
		js = append(js, filterJumps(chain)...)
	}
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

// rules counts the rules in our chains, without the canary's (its rule and the jumps to it).
func (t *tableState) rules() int {
	n := 0
	for c, r := range t.chains {
		if c == ChainCanary {
			continue
		}
		for _, rule := range r {
			if rule != canaryJump {
				n++
			}
		}
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
	proto     string // "tcp" or "udp"
	container string // containerTarget of the proxy port
	host      string // hostTarget of the proxy port
	external  string // containerTarget of the external proxy port
	rejectInt bool
	rejectExt bool
	split     bool     // the spec's external traffic has its own proxy port
	pods      []string // "-s" values of PodCIDRs of this family
	scratch   []byte   // reused to write a rule's text before it becomes a string
}

// buildRules is the pure function from specs to the wanted rules of one family. Specs come sorted
// by portal.CompareSpecs (Sync sorts them once for both families), and each spec's rules in the legacy order (cluster IP, external IPs, load-balancer
// IPs, node port), so the text is stable. Invalid specs are returned for the caller to report.
func buildRules(cfg Config, fam portal.Family, specs []portal.Spec) (familyRules, []error) {
	b := newRuleBuilder(cfg, fam)
	var errs []error
	if cfg.KernelPath {
		errs = b.addKernelSpecs(cfg, specs)
	}
	for i := range specs {
		if specs[i].Kernel != nil {
			if !cfg.KernelPath {
				errs = append(errs, fmt.Errorf("portal %s: the kernel data path is off on this node", specs[i].Name))
			}
			continue
		}
		if err := validate(&specs[i]); err != nil {
			errs = append(errs, err)
			continue
		}
		b.add(&specs[i])
	}
	addCanary(b.out)
	return b.out, errs
}

// newRuleBuilder starts fam's rules with our chains, empty, and the jumps to them, and keeps the
// pod CIDRs and node-port addresses of fam.
func newRuleBuilder(cfg Config, fam portal.Family) *ruleBuilder {
	b := &ruleBuilder{fam: fam, bind: cfg.BindAddress, hostIP: cfg.HostIPs[fam], protect: cfg.ProtectProxyPorts,
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
	for _, p := range cfg.PodCIDRs {
		if portal.FamilyOf(p.Addr()) == fam {
			b.pods = append(b.pods, p.Masked().String())
		}
	}
	for _, p := range cfg.NodePortAddresses {
		if portal.FamilyOf(p.Addr()) == fam {
			b.npDsts = append(b.npDsts, p.Masked().String())
		}
	}
	return b
}

// addKernelSpecs adds the kernel path's rules for the valid kernel-path specs, returning the
// invalid ones' errors.
func (b *ruleBuilder) addKernelSpecs(cfg Config, specs []portal.Spec) []error {
	var errs []error
	var kspecs []portal.Spec
	for i := range specs {
		if specs[i].Kernel == nil {
			continue
		}
		if err := validateKernel(&specs[i]); err != nil {
			errs = append(errs, err)
			continue
		}
		kspecs = append(kspecs, specs[i])
	}
	b.addKernel(cfg, kspecs)
	return errs
}

// The canary chain's one rule, and the jump every other chain of ours ends with.
const (
	canaryRule = `-m comment --comment "kube-portal-proxy canary" -j RETURN`
	canaryJump = "-j " + ChainCanary
)

// addCanary adds the canary chain to each table and a jump to it at the end of every other chain
// of ours: the portals' fixed chains and, with the kernel path on, its top-level and per-port
// chains too (KUBE-SERVICES, KUBE-MARK-MASQ, KUBE-SVC-*, KUBE-SEP-*...), so the periodic check
// sees a flush of any of them. The jump changes nothing a packet does: the canary returns at
// once, and in a chain that ends in a DNAT or an unconditional jump (KUBE-SEP, KUBE-SVC) it is
// never reached. It is appended after kernel.Build's rules, so KUBE-SERVICES' node-port jump still
// comes after every capture, and head inserts (restorePlan) keep it last.
func addCanary(out familyRules) {
	for _, table := range tables {
		st := out[table]
		for _, c := range canaried(table, st) {
			st.chains[c] = append(st.chains[c], canaryJump)
		}
		st.chains[ChainCanary] = []string{canaryRule}
	}
}

// canaried lists the chains of st that end with the canary jump: every chain of ours but the canary.
func canaried(table string, st *tableState) []string {
	out := make([]string, 0, len(st.chains))
	for c := range st.chains {
		if c != ChainCanary && isOwned(table, c) {
			out = append(out, c)
		}
	}
	return out
}

// canaryRefs is how many references the canary chain of a table has when the table is as st says:
// one per canary jump in our chains. It counts the jumps rather than the chains, so a table
// programmed by a version that put no jump in some chains (the kernel path's, before) is judged
// by what it holds.
func canaryRefs(st *tableState) int {
	n := 0
	for c, rules := range st.chains {
		if c == ChainCanary {
			continue
		}
		for _, r := range rules {
			if r == canaryJump {
				n++
			}
		}
	}
	return n
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
	b.proto = strings.ToLower(string(s.Protocol))
	b.container, b.host = b.containerTarget(s.ProxyPort), b.hostTarget(s.ProxyPort)
	b.external = b.container
	if ext := s.ExternalPort(); ext != s.ProxyPort {
		b.external = b.containerTarget(ext)
	}
	b.rejectInt, b.rejectExt = s.RejectInternal, s.RejectExternal
	b.split = s.ExternalPort() != s.ProxyPort
	for _, ip := range b.ofFamily(s.ClusterIPs) {
		b.clusterPortal(s, ip)
	}
	for _, ip := range b.ofFamily(s.ExternalIPs) {
		b.externalPortal(s, ip)
	}
	for _, ip := range b.ofFamily(s.LoadBalancerIPs) {
		b.loadBalancerPortal(s, ip)
	}
	if s.NodePort != 0 && len(b.npDsts) > 0 {
		for _, d := range b.npDsts {
			np := b.common(d, s.NodePort)
			b.podsAsCluster(ChainNodePortContainer, np)
			b.steer(ChainNodePortContainer, np, b.external, b.rejectExt)
			b.steer(ChainNodePortHost, np, b.host, b.rejectInt)
			if b.rejectInt || b.rejectExt {
				b.rule(tableFilter, ChainReject, np+" -m addrtype --dst-type LOCAL", b.rejectTarget())
			}
		}
		// Legacy: accept new connections to the proxy port (the node port after translation).
		for _, pp := range s.ProxyPorts() {
			b.commonRule(tableFilter, ChainNodePortNonLocal, "", pp, "-m state --state NEW -j ACCEPT")
		}
	}
	if b.protect {
		for _, pp := range s.ProxyPorts() {
			b.commonRule(tableFilter, ChainGuard, "! -i lo ", pp,
				"-m conntrack --ctstate NEW -m conntrack ! --ctstate DNAT -j DROP")
		}
	}
}

// steer adds a nat portal rule, or nothing when its class of traffic is refused (the REJECT rule
// for the same destination is added by the caller).
func (b *ruleBuilder) steer(chain, match, target string, refused bool) {
	if !refused {
		b.rule(tableNAT, chain, match, target)
	}
}

// podsAsCluster steers pod traffic to an external portal of a split port to the cluster socket, as
// kube-proxy short-circuits it (no client address to keep, and a pod should reach the service as
// well as a remote client does). With cluster traffic refused, the pods' packets are left alone
// (RETURN) for the filter REJECT rule of the same destination.
func (b *ruleBuilder) podsAsCluster(chain, match string) {
	if !b.split {
		return
	}
	for _, src := range b.pods {
		target := b.container
		if b.rejectInt {
			target = "-j RETURN"
		}
		b.rule(tableNAT, chain, "-s "+src+" "+match, target)
	}
}

// reject refuses new connections to a portal destination; one rule serves both classes, since
// translated traffic no longer matches it.
func (b *ruleBuilder) reject(match string) {
	if b.rejectInt || b.rejectExt {
		b.rule(tableFilter, ChainReject, match, b.rejectTarget())
	}
}

// rejectTarget answers TCP with a reset and UDP with ICMP port unreachable (iptables-save spelling).
func (b *ruleBuilder) rejectTarget() string {
	switch {
	case b.proto == "tcp":
		return "-j REJECT --reject-with tcp-reset"
	case b.fam == portal.IPv6:
		return "-j REJECT --reject-with icmp6-port-unreachable"
	}
	return "-j REJECT --reject-with icmp-port-unreachable"
}

// clusterPortal is the portal of a cluster IP: any packet to it is cluster traffic.
func (b *ruleBuilder) clusterPortal(s *portal.Spec, ip netip.Addr) {
	m := b.common(hostPrefix(ip), s.Port)
	if b.rejectInt {
		b.rule(tableFilter, ChainReject, m, b.rejectTarget())
		return
	}
	b.rule(tableNAT, ChainPortalsContainer, m, b.container)
	b.rule(tableNAT, ChainPortalsHost, m, b.host)
}

// loadBalancerPortal is the portal of a load-balancer IP: external traffic from pods and outside,
// cluster traffic from the node. With source ranges only those clients are steered, and the
// firewall chain drops the rest.
func (b *ruleBuilder) loadBalancerPortal(s *portal.Spec, ip netip.Addr) {
	d := hostPrefix(ip)
	m := b.common(d, s.Port)
	if len(s.SourceRanges) == 0 {
		b.podsAsCluster(ChainPortalsContainer, m)
		b.steer(ChainPortalsContainer, m, b.external, b.rejectExt)
		b.steer(ChainPortalsHost, m, b.host, b.rejectInt)
		b.reject(m)
		return
	}
	for _, src := range s.SourceRanges {
		if portal.FamilyOf(src.Addr()) != b.fam {
			continue
		}
		sm := "-s " + src.Masked().String() + " " + m
		b.steer(ChainPortalsContainer, sm, b.external, b.rejectExt)
		b.steer(ChainPortalsHost, sm, b.host, b.rejectInt)
		b.reject(sm)
	}
	b.rule(tableFilter, ChainFirewall, m, "-j DROP")
}

// externalPortal is the portal of an external IP: every packet that comes in for it (from pods,
// bridged or routed, and from outside) reaches the proxy, as in every kube-proxy mode since the
// userspace one; the node's own traffic only when the IP is local. (Legacy userspace mode left
// packets that came in on a bridge port alone unless the IP was local, so pods on a bridge CNI
// could not reach a Service through an external IP no node holds: upstream's "should be possible
// to connect to a service via ExternalIP when the external IP is not assigned to a node".)
func (b *ruleBuilder) externalPortal(s *portal.Spec, ip netip.Addr) {
	m := b.common(hostPrefix(ip), s.Port)
	b.podsAsCluster(ChainPortalsContainer, m)
	b.steer(ChainPortalsContainer, m, b.external, b.rejectExt)
	b.steer(ChainPortalsHost, m+" -m addrtype --dst-type LOCAL", b.host, b.rejectInt)
	b.reject(m)
}

func (b *ruleBuilder) rule(table, chain, match, target string) {
	t := b.out[table]
	t.chains[chain] = append(t.chains[chain], match+" "+target)
}

// containerTarget: REDIRECT goes to the primary address of the incoming interface, so replies
// leave the way the request came and un-NAT correctly (DNAT to the node IP from a bridge would
// answer from the wrong address). A specific bind address is the only place the socket listens.
func (b *ruleBuilder) containerTarget(port uint16) string {
	if b.bind.IsUnspecified() {
		return "-j REDIRECT --to-ports " + strconv.Itoa(int(port))
	}
	return "-j DNAT --to-destination " + netip.AddrPortFrom(b.bind, port).String()
}

// hostTarget: REDIRECT of locally generated packets goes to 127.0.0.1 while replies come from the
// node IP, so host traffic is DNATed to a non-loopback node address instead.
func (b *ruleBuilder) hostTarget(port uint16) string {
	ip := b.hostIP
	if !b.bind.IsUnspecified() {
		ip = b.bind
	}
	return "-j DNAT --to-destination " + netip.AddrPortFrom(ip, port).String()
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
// protocol first, then the comment and port match modules in the order they were given. It is
// written in the builder's scratch buffer, so the string is the one allocation.
func (b *ruleBuilder) common(dst string, dport uint16) string {
	b.scratch = b.appendCommon(b.scratch[:0], dst, dport)
	return string(b.scratch)
}

func (b *ruleBuilder) appendCommon(buf []byte, dst string, dport uint16) []byte {
	if dst != "" {
		buf = append(append(append(buf, "-d "...), dst...), ' ')
	}
	buf = append(buf, b.match...)
	return strconv.AppendUint(buf, uint64(dport), 10)
}

// commonRule adds the rule before+common("", dport)+" "+target, written whole in the scratch
// buffer: the guard and node-port accept rules, one per proxy port, are a third of a sync's
// rules, and building their parts as strings first doubled what they allocated.
func (b *ruleBuilder) commonRule(table, chain, before string, dport uint16, target string) {
	buf := b.appendCommon(append(b.scratch[:0], before...), "", dport)
	b.scratch = append(append(buf, ' '), target...)
	t := b.out[table]
	t.chains[chain] = append(t.chains[chain], string(b.scratch))
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
