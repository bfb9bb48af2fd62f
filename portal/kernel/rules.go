package kernel

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Config is what the kernel chains need to know of the node.
type Config struct {
	// PodCIDRs (--cluster-cidr) are the sources that are pods: traffic to a cluster IP from
	// anywhere else is masqueraded (kube-proxy's local detector; the first prefix of the family
	// is used), and pods reaching an externalTrafficPolicy: Local port's external destinations
	// are sent by the Cluster policy. Empty: neither happens.
	PodCIDRs []netip.Prefix
	// NodePortAddresses is --nodeport-addresses; empty means every local address but loopback.
	NodePortAddresses []netip.Prefix
	// NodeIPs are the node's addresses: a source range that holds one also admits the node's own
	// connections to the load-balancer IPs (they arrive from the load-balancer IP itself).
	NodeIPs []netip.Addr
	// ConntrackTCPLiberal: nf_conntrack_tcp_be_liberal is set, so out-of-window TCP packets are
	// not INVALID and KUBE-FORWARD need not drop INVALID ones (as kube-proxy decides).
	ConntrackTCPLiberal bool
	// NoRandomFully leaves --random-fully off KUBE-POSTROUTING's MASQUERADE, for an iptables or
	// kernel without it (iptables.HasRandomFully tells); kube-proxy adds it only when supported.
	NoRandomFully bool
}

// Tables is the wanted content of the kernel path for one family: per table, chain name → rule
// bodies (the text after "-A CHAIN "), in iptables-save's spelling.
type Tables map[string]map[string][]string

// Jump is a rule in a built-in chain that leads into a top-level chain; kube-proxy inserts them
// at the head of their chains.
type Jump struct {
	Table, Chain, Body string
}

// Jumps are the kernel path's jump rules, in the order they appear in their chains.
var Jumps = []Jump{
	{TableFilter, "INPUT", `-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j ` + ChainExternalServices},
	{TableFilter, "INPUT", `-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j ` + ChainProxyFirewall},
	{TableFilter, "FORWARD", `-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j ` + ChainProxyFirewall},
	{TableFilter, "FORWARD", `-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j ` + ChainServices},
	{TableFilter, "FORWARD", `-m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j ` + ChainExternalServices},
	{TableFilter, "FORWARD", `-m comment --comment "kubernetes forwarding rules" -j ` + ChainForward},
	{TableFilter, "OUTPUT", `-m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j ` + ChainProxyFirewall},
	{TableFilter, "OUTPUT", `-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j ` + ChainServices},
	{TableNAT, "PREROUTING", `-m comment --comment "kubernetes service portals" -j ` + ChainServices},
	{TableNAT, "OUTPUT", `-m comment --comment "kubernetes service portals" -j ` + ChainServices},
	{TableNAT, "POSTROUTING", `-m comment --comment "kubernetes postrouting rules" -j ` + ChainPostrouting},
}

// Build is the pure function from specs to the kernel path's chains of one family: the
// top-level chains with their fixed rules, and the chains of every spec with Kernel set (others
// are skipped). Specs come sorted (portal.CompareSpecs), so the text is stable.
func Build(cfg Config, fam portal.Family, specs []portal.Spec) Tables {
	b := builder{fam: fam, out: Tables{TableNAT: {}, TableFilter: {}}}
	for table, chains := range TopChains {
		for _, c := range chains {
			b.out[table][c] = nil
		}
	}
	for _, p := range cfg.PodCIDRs {
		if portal.FamilyOf(p.Addr()) == fam && b.podCIDR == "" {
			b.podCIDR = p.Masked().String()
		}
	}
	for _, ip := range cfg.NodeIPs {
		if portal.FamilyOf(ip) == fam {
			b.nodeIPs = append(b.nodeIPs, ip.Unmap())
		}
	}
	b.fixed(cfg.ConntrackTCPLiberal, !cfg.NoRandomFully)
	for i := range specs {
		if specs[i].Kernel != nil {
			b.port(&specs[i])
		}
	}
	b.nodePortsJump(cfg.NodePortAddresses)
	return b.out
}

type builder struct {
	fam     portal.Family
	podCIDR string // "" when unknown
	nodeIPs []netip.Addr
	out     Tables
}

func (b *builder) add(table, chain string, rules ...string) {
	b.out[table][chain] = append(b.out[table][chain], rules...)
}

// fixed writes the rules of the top-level chains that do not depend on any service.
func (b *builder) fixed(liberal, randomFully bool) {
	mark := MasqueradeMark + "/" + MasqueradeMark
	// Masquerade what KUBE-MARK-MASQ marked, clearing the mark first so a packet that passes
	// through the stack again (a bridge, a tunnel) is not masqueraded twice. MASQUERADE ends the
	// chain, so the mark is cleared before it, as kube-proxy does.
	masq := `-m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE`
	if randomFully {
		// Fully random source ports avoid the SNAT port races of many connections at once.
		masq += " --random-fully"
	}
	b.add(TableNAT, ChainPostrouting,
		"-m mark ! --mark "+mark+" -j RETURN",
		"-j MARK --set-xmark "+MasqueradeMark+"/0x0",
		masq)
	b.add(TableNAT, ChainMarkMasq, "-j MARK --set-xmark "+mark)
	// Forwarded service traffic is accepted even where FORWARD's policy drops (Docker sets it);
	// INVALID packets are dropped, since they could reset a NATed connection (kubernetes#74839),
	// unless conntrack is liberal and marks none INVALID for being out of window.
	if !liberal {
		b.add(TableFilter, ChainForward, "-m conntrack --ctstate INVALID -j DROP")
	}
	b.add(TableFilter, ChainForward,
		`-m comment --comment "kubernetes forwarding rules" -m mark --mark `+mark+" -j ACCEPT",
		`-m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT`)
}

// nodePortsJump ends KUBE-SERVICES with the jump to KUBE-NODEPORTS: every local address (but
// loopback: node ports on 127.0.0.1 would need route_localnet, which kube-proxy's own
// --iptables-localhost-nodeports=false leaves off too), or the --nodeport-addresses prefixes.
func (b *builder) nodePortsJump(prefixes []netip.Prefix) {
	const comment = `-m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" `
	var dsts []string
	for _, p := range prefixes {
		if portal.FamilyOf(p.Addr()) == b.fam {
			dsts = append(dsts, "-d "+p.Masked().String()+" ")
		}
	}
	if len(prefixes) == 0 {
		lo := "! -d 127.0.0.0/8 "
		if b.fam == portal.IPv6 {
			lo = "! -d ::1/128 "
		}
		dsts = []string{lo}
	}
	for _, d := range dsts {
		b.add(TableNAT, ChainServices, d+comment+"-m addrtype --dst-type LOCAL -j "+ChainNodePorts)
	}
}

// portRules is one spec's names and the text its rules share.
type portRules struct {
	name             string // "ns/name:port", every rule's comment
	proto            string
	svc, svl, ext    string
	fw               string
	quoted           string // strconv.Quote(name)
	affinitySeconds  int
	hasEndpoints     bool
	hasInt, hasExt   bool
	usesSVC, usesSVL bool
	usesExt, usesFW  bool
	intChain         string
	extPolicyChain   string
	lbChain          string
	intFilterTarget  string
	intFilterComment string
	extFilterTarget  string
	extFilterComment string
	cluster, local   []string // endpoints "ip:port", sorted as kube-proxy sorts them (as text)
	// the service's addresses of the builder's family
	clusterIPs, externalIPs, lbIPs []netip.Addr
}

// port writes the chains of one kernel-path service port, following kube-proxy's
// syncProxyRules: the captures in KUBE-SERVICES / KUBE-NODEPORTS, the filter rules for traffic
// without endpoints, then the port's own chains.
func (b *builder) port(s *portal.Spec) {
	r := b.portRules(s)
	b.filterTargets(&r)
	for _, ip := range r.clusterIPs {
		b.clusterIP(&r, s.Port, ip)
	}
	b.externalCaptures(&r, s)
	if r.usesExt {
		b.externalChain(&r, s.Kernel.ExternalLocal)
	}
	if r.usesFW {
		b.firewallChain(&r, s, r.lbIPs)
	}
	if r.usesSVC {
		b.spread(&r, r.svc, r.cluster)
	}
	if r.usesSVL {
		b.spread(&r, r.svl, r.local)
	}
	b.endpointChains(&r)
}

// portRules names the chains of s and decides which of them exist: the cluster (SVC) and local
// (SVL) spreads, the external (EXT) and firewall (FW) chains, and where internal and external
// traffic goes.
func (b *builder) portRules(s *portal.Spec) portRules {
	k := s.Kernel
	r := portRules{name: s.Name.String(), proto: protocol(s.Protocol), affinitySeconds: k.AffinitySeconds}
	r.quoted = strconv.Quote(r.name)
	r.svc = ServiceChain(PrefixService, s.Name, s.Protocol)
	r.svl = ServiceChain(PrefixLocal, s.Name, s.Protocol)
	r.ext = ServiceChain(PrefixExternal, s.Name, s.Protocol)
	r.fw = ServiceChain(PrefixFirewall, s.Name, s.Protocol)
	r.cluster, r.local = b.endpoints(k.Cluster), b.endpoints(k.Local)
	r.clusterIPs, r.externalIPs, r.lbIPs = b.ofFamily(s.ClusterIPs), b.ofFamily(s.ExternalIPs), b.ofFamily(s.LoadBalancerIPs)

	external := s.NodePort != 0 || len(r.externalIPs) > 0 || len(r.lbIPs) > 0
	r.hasEndpoints = k.AnyEndpoints || len(r.cluster) > 0 || len(r.local) > 0
	r.usesSVC = len(r.cluster) > 0 && (!k.InternalLocal || external)
	r.usesSVL = len(r.local) > 0 && (k.InternalLocal || (k.ExternalLocal && external))
	r.intChain, r.hasInt = r.svc, r.hasEndpoints
	if k.InternalLocal {
		r.intChain, r.hasInt = r.svl, len(r.local) > 0
	}
	r.extPolicyChain, r.hasExt = r.svc, r.hasEndpoints
	if k.ExternalLocal {
		r.extPolicyChain, r.hasExt = r.svl, len(r.local) > 0
	}
	// A policy chain exists only with endpoints in it: without, its traffic is refused instead.
	r.hasInt = r.hasInt && (r.intChain != r.svc || r.usesSVC)
	r.hasExt = r.hasExt && (r.extPolicyChain != r.svc || r.usesSVC)
	r.usesExt = r.hasEndpoints && external
	r.lbChain = r.ext
	// Source ranges of the other family only still close this family's load-balancer IPs to
	// everyone (kube-proxy would leave them open); a range list is an allow list.
	r.usesFW = r.hasEndpoints && len(r.lbIPs) > 0 && len(s.SourceRanges) > 0
	if r.usesFW {
		r.lbChain = r.fw
	}
	return r
}

// externalCaptures writes the captures of the external IPs, load-balancer IPs and node port, and
// the filter rules that refuse their traffic when there is no endpoint to send it to.
func (b *builder) externalCaptures(r *portRules, s *portal.Spec) {
	for _, ip := range r.externalIPs {
		m := b.match("-d "+hostPrefix(ip)+" ", r.proto, s.Port)
		if r.hasEndpoints {
			b.add(TableNAT, ChainServices, m.comment(r.name+" external IP")+m.port()+"-j "+r.ext)
		}
		if !r.hasExt {
			b.add(TableFilter, ChainExternalServices, m.comment(r.extFilterComment)+m.port()+r.extFilterTarget)
		}
	}
	for _, ip := range r.lbIPs {
		m := b.match("-d "+hostPrefix(ip)+" ", r.proto, s.Port)
		if r.hasEndpoints {
			b.add(TableNAT, ChainServices, m.comment(r.name+" loadbalancer IP")+m.port()+"-j "+r.lbChain)
		}
		if r.usesFW {
			b.add(TableFilter, ChainProxyFirewall, m.comment(r.name+" traffic not accepted by "+r.fw)+m.port()+"-j DROP")
		}
	}
	if !r.hasExt {
		for _, ip := range r.lbIPs {
			m := b.match("-d "+hostPrefix(ip)+" ", r.proto, s.Port)
			b.add(TableFilter, ChainExternalServices, m.comment(r.extFilterComment)+m.port()+r.extFilterTarget)
		}
	}
	if s.NodePort != 0 {
		m := b.match("", r.proto, s.NodePort)
		if r.hasEndpoints {
			b.add(TableNAT, ChainNodePorts, m.comment(r.name)+m.port()+"-j "+r.ext)
		}
		if !r.hasExt {
			b.add(TableFilter, ChainExternalServices,
				m.comment(r.extFilterComment)+"-m addrtype --dst-type LOCAL "+m.port()+r.extFilterTarget)
		}
	}
}

// filterTargets decides what the filter table does with traffic that has no endpoint: REJECT
// when the port has none at all, DROP when only a Local policy finds none on this node (a load
// balancer's health check takes the node out; a retry reaches another node).
func (b *builder) filterTargets(r *portRules) {
	reject := "-j REJECT --reject-with icmp-port-unreachable"
	if b.fam == portal.IPv6 {
		reject = "-j REJECT --reject-with icmp6-port-unreachable"
	}
	if !r.hasEndpoints {
		r.intFilterTarget, r.extFilterTarget = reject, reject
		r.intFilterComment = r.name + " has no endpoints"
		r.extFilterComment = r.intFilterComment
		return
	}
	r.intFilterTarget, r.extFilterTarget = "-j DROP", "-j DROP"
	r.intFilterComment = r.name + " has no local endpoints"
	r.extFilterComment = r.intFilterComment
}

// clusterIP captures one cluster IP: to the internal policy chain, or refused in the filter table.
// Traffic from outside the pod network is marked for masquerade first, so replies come back
// through this node (a node, or a router with a static route to the service range, sending to a
// cluster IP).
func (b *builder) clusterIP(r *portRules, port uint16, ip netip.Addr) {
	d := "-d " + hostPrefix(ip) + " "
	m := b.match(d, r.proto, port)
	if !r.hasInt {
		b.add(TableFilter, ChainServices, m.comment(r.intFilterComment)+m.port()+r.intFilterTarget)
		return
	}
	b.add(TableNAT, ChainServices, m.comment(r.name+" cluster IP")+m.port()+"-j "+r.intChain)
	if b.podCIDR != "" {
		mm := b.match("! -s "+b.podCIDR+" "+d, r.proto, port)
		b.add(TableNAT, r.intChain, mm.comment(r.name+" cluster IP")+mm.port()+"-j "+ChainMarkMasq)
	}
}

// externalChain is KUBE-EXT: external destinations (node port, external IPs, load-balancer IPs).
// Under the Cluster policy everything is masqueraded (the endpoint may be on another node). Under
// Local the client address is kept, and traffic from pods and from the node itself, which has no
// address worth keeping, short-circuits to the Cluster chain.
func (b *builder) externalChain(r *portRules, local bool) {
	if !local {
		b.add(TableNAT, r.ext, `-m comment --comment "masquerade traffic for `+r.name+` external destinations" -j `+ChainMarkMasq)
	} else if r.usesSVC {
		if b.podCIDR != "" {
			b.add(TableNAT, r.ext, "-s "+b.podCIDR+` -m comment --comment "pod traffic for `+r.name+` external destinations" -j `+r.svc)
		}
		b.add(TableNAT, r.ext,
			`-m comment --comment "masquerade LOCAL traffic for `+r.name+` external destinations" -m addrtype --src-type LOCAL -j `+ChainMarkMasq,
			`-m comment --comment "route LOCAL traffic for `+r.name+` external destinations" -m addrtype --src-type LOCAL -j `+r.svc)
	}
	if r.hasExt {
		b.add(TableNAT, r.ext, "-j "+r.extPolicyChain)
	}
}

// firewallChain is KUBE-FW: only clients in the source ranges go on to KUBE-EXT; the rest leave
// it untranslated and KUBE-PROXY-FIREWALL drops them in the filter table.
func (b *builder) firewallChain(r *portRules, s *portal.Spec, lbIPs []netip.Addr) {
	comment := "-m comment --comment " + strconv.Quote(r.name+" loadbalancer IP") + " "
	fromNode := false
	for _, src := range s.SourceRanges {
		if portal.FamilyOf(src.Addr()) != b.fam {
			continue
		}
		b.add(TableNAT, r.fw, "-s "+src.Masked().String()+" "+comment+"-j "+r.ext)
		fromNode = fromNode || slices.ContainsFunc(b.nodeIPs, src.Contains)
	}
	if fromNode {
		for _, ip := range lbIPs {
			b.add(TableNAT, r.fw, "-s "+hostPrefix(ip)+" "+comment+"-j "+r.ext)
		}
	}
	b.add(TableNAT, r.fw, "-m comment --comment "+strconv.Quote("other traffic to "+r.name+" will be dropped by KUBE-PROXY-FIREWALL"))
}

// spread is a KUBE-SVC or KUBE-SVL chain: with affinity, first a rule per endpoint that sends a
// client seen recently to the same endpoint; then rule i of n matches with probability 1/(n-i),
// so each endpoint gets 1/n of new flows and the last rule takes what is left.
func (b *builder) spread(r *portRules, chain string, eps []string) {
	comment := "-m comment --comment " + r.quoted + " "
	if r.affinitySeconds > 0 {
		secs := strconv.Itoa(r.affinitySeconds)
		for _, ep := range eps {
			sep := r.sep(ep)
			b.add(TableNAT, chain, comment+"-m recent --rcheck --seconds "+secs+" --reap --name "+sep+" "+b.recentMask()+"-j "+sep)
		}
	}
	for i, ep := range eps {
		if i < len(eps)-1 {
			b.add(TableNAT, chain, comment+"-m statistic --mode random --probability "+Probability(len(eps)-i)+" -j "+r.sep(ep))
		} else {
			b.add(TableNAT, chain, comment+"-j "+r.sep(ep))
		}
	}
}

// endpointChains writes one KUBE-SEP chain per endpoint either policy chain uses: a packet from
// the endpoint itself (a pod reaching its own service) is marked for masquerade, or the reply
// would go straight back to the pod, bypassing the un-DNAT; with affinity the client is recorded;
// then DNAT.
func (b *builder) endpointChains(r *portRules) {
	var eps []string
	if r.usesSVC {
		eps = append(eps, r.cluster...)
	}
	if r.usesSVL {
		for _, ep := range r.local {
			if !slices.Contains(eps, ep) {
				eps = append(eps, ep)
			}
		}
	}
	comment := "-m comment --comment " + r.quoted + " "
	for _, ep := range eps {
		sep := r.sep(ep)
		ap, _ := netip.ParseAddrPort(ep)
		b.add(TableNAT, sep, "-s "+hostPrefix(ap.Addr())+" "+comment+"-j "+ChainMarkMasq)
		affinity := ""
		if r.affinitySeconds > 0 {
			affinity = "-m recent --set --name " + sep + " " + b.recentMask()
		}
		b.add(TableNAT, sep, "-p "+r.proto+" "+comment+affinity+"-m "+r.proto+" -j DNAT --to-destination "+ep)
	}
}

func (r *portRules) sep(ep string) string {
	return PrefixEndpoint + hash(r.name+r.proto+ep)
}

// recentMask is how iptables-save prints the recent match's default source mask.
func (b *builder) recentMask() string {
	if b.fam == portal.IPv6 {
		return "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource "
	}
	return "--mask 255.255.255.255 --rsource "
}

// endpoints renders the endpoints of this family as text, sorted as text (kube-proxy's order).
func (b *builder) endpoints(eps []netip.AddrPort) []string {
	out := make([]string, 0, len(eps))
	for _, ep := range eps {
		if ep.IsValid() && portal.FamilyOf(ep.Addr()) == b.fam {
			out = append(out, netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port()).String())
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func (b *builder) ofFamily(ips []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if ip.IsValid() && portal.FamilyOf(ip) == b.fam {
			out = append(out, ip.Unmap())
		}
	}
	return out
}

// match is the address and protocol part of a capture rule, in iptables-save's order: addresses,
// "-p", then the modules in the order given (comment, then the port match).
type match struct {
	prefix string // "-s …/-d … -p tcp "
	proto  string
	dport  uint16
}

func (b *builder) match(addrs, proto string, dport uint16) match {
	return match{prefix: addrs + "-p " + proto + " ", proto: proto, dport: dport}
}

func (m match) comment(c string) string {
	return m.prefix + "-m comment --comment " + strconv.Quote(c) + " "
}

func (m match) port() string {
	return "-m " + m.proto + " --dport " + strconv.Itoa(int(m.dport)) + " "
}

func hostPrefix(ip netip.Addr) string {
	return netip.PrefixFrom(ip, ip.BitLen()).String()
}

// Render prints tables the way iptables-save lists them (without counters): top-level chains
// first, the per-port chains by name, then every chain's rules in that order.
func Render(t Tables, jumps bool) string {
	var sb strings.Builder
	for _, table := range []string{TableFilter, TableNAT} {
		chains := ChainOrder(table, t[table])
		sb.WriteString("*" + table + "\n")
		for _, c := range chains {
			sb.WriteString(":" + c + " - [0:0]\n")
		}
		if jumps {
			for _, j := range Jumps {
				if j.Table == table {
					sb.WriteString("-A " + j.Chain + " " + j.Body + "\n")
				}
			}
		}
		for _, c := range chains {
			for _, r := range t[table][c] {
				sb.WriteString("-A " + c + " " + r + "\n")
			}
		}
		sb.WriteString("COMMIT\n")
	}
	return sb.String()
}

// ChainOrder lists the chains of a table that are in m: the top-level ones in declaration order,
// then the per-port ones sorted by name.
func ChainOrder[V any](table string, m map[string]V) []string {
	var out, dyn []string
	for _, c := range TopChains[table] {
		if _, ok := m[c]; ok {
			out = append(out, c)
		}
	}
	for c := range m {
		if IsServiceChain(table, c) {
			dyn = append(dyn, c)
		}
	}
	slices.Sort(dyn)
	return append(out, dyn...)
}
