// Package kernel builds the kernel data path of a service port: kube-proxy's iptables-mode chains
// (KUBE-SERVICES → KUBE-SVC/SVL/EXT/FW-<hash> → KUBE-SEP-<hash>, KUBE-MARK-MASQ, KUBE-POSTROUTING,
// KUBE-NODEPORTS, and the filter table's REJECT/DROP chains), named and commented as kube-proxy
// names them, so the packets of such a port never reach user space. It is a pure function from
// specs to rule text in iptables-save's spelling; portal/iptables applies it in the same
// iptables-restore as the portal rules. See README.md for the packet path.
package kernel

import (
	"crypto/sha256"
	"encoding/base32"
	"math"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// The tables the kernel path writes to.
const (
	TableNAT    = "nat"
	TableFilter = "filter"
)

// The top-level chains, kube-proxy's names.
const (
	ChainServices         = "KUBE-SERVICES"
	ChainExternalServices = "KUBE-EXTERNAL-SERVICES"
	ChainNodePorts        = "KUBE-NODEPORTS"
	ChainPostrouting      = "KUBE-POSTROUTING"
	ChainMarkMasq         = "KUBE-MARK-MASQ"
	ChainForward          = "KUBE-FORWARD"
	ChainProxyFirewall    = "KUBE-PROXY-FIREWALL"
)

// The prefixes of the per-service-port chains (nat table), each followed by 16 hash characters.
const (
	PrefixService  = "KUBE-SVC-" // Cluster policy: spreads over the cluster endpoints
	PrefixLocal    = "KUBE-SVL-" // Local policy: spreads over the endpoints on this node
	PrefixExternal = "KUBE-EXT-" // external destinations: masquerade, short-circuit, then policy
	PrefixFirewall = "KUBE-FW-"  // loadBalancerSourceRanges
	PrefixEndpoint = "KUBE-SEP-" // one endpoint: hairpin mark, affinity, DNAT
)

// MasqueradeMark is kube-proxy's default mark (--iptables-masquerade-bit 14): packets that
// KUBE-POSTROUTING must masquerade.
const MasqueradeMark = "0x4000"

// TopChains are the top-level chains per table, in the order they are declared.
var TopChains = map[string][]string{
	TableNAT:    {ChainServices, ChainNodePorts, ChainPostrouting, ChainMarkMasq},
	TableFilter: {ChainServices, ChainExternalServices, ChainForward, ChainProxyFirewall},
}

// IsServiceChain reports whether a nat chain is one of the per-service-port chains.
func IsServiceChain(table, chain string) bool {
	if table != TableNAT || len(chain) < len(PrefixFirewall) || !strings.HasPrefix(chain, "KUBE-") {
		return false
	}
	for _, p := range []string{PrefixService, PrefixLocal, PrefixExternal, PrefixFirewall, PrefixEndpoint} {
		if strings.HasPrefix(chain, p) {
			return true
		}
	}
	return false
}

// Ordered reports whether the order of a kernel chain's rules matters, so it must be rewritten
// whole when it changes (a rule inserted at its head would, say, DNAT before the hairpin mark, or
// end a spread early). The KUBE-SERVICES rules have distinct destinations and its last rule, the
// node-port jump, never changes while the process runs; the filter chains only drop or refuse.
func Ordered(table, chain string) bool {
	return IsServiceChain(table, chain) || (table == TableNAT && (chain == ChainPostrouting || chain == ChainMarkMasq)) ||
		(table == TableFilter && chain == ChainForward)
}

// hash is kube-proxy's portProtoHash: the first 16 characters of the base32 of the SHA-256 of
// the text, short enough for iptables' 28-character chain names.
func hash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return base32.StdEncoding.EncodeToString(sum[:])[:16]
}

// protocol is the lower-case protocol kube-proxy hashes and matches with.
func protocol(p service.Protocol) string { return strings.ToLower(string(p)) }

// ServiceChain is the chain of a service port with the given prefix (PrefixService, PrefixLocal,
// PrefixExternal or PrefixFirewall): the hash of "namespace/name:port" and the protocol, so
// "default/kubernetes:https" over TCP is KUBE-SVC-NPX46M4PTMTKRN6Y on every kube-proxy node.
func ServiceChain(prefix string, name service.ServicePortName, proto service.Protocol) string {
	return prefix + hash(name.String()+protocol(proto))
}

// EndpointChain is the KUBE-SEP chain of one endpoint of a service port ("10.0.0.1:80", IPv6 in
// brackets, is part of the hash).
func EndpointChain(name service.ServicePortName, proto service.Protocol, endpoint string) string {
	return PrefixEndpoint + hash(name.String()+protocol(proto)+endpoint)
}

// Probability is the --probability of the i-th of n rules spreading over n endpoints (i from 0):
// 1/(n-i), as kube-proxy writes it (%0.10f), then as iptables-save prints it. The statistic match
// keeps the probability as a 31-bit fraction and prints it with 11 decimals, so kube-proxy's
// 0.3333333333 reads back as 0.33333333349. (Seed 003's 0.33332999982 is the read-back of an
// older kube-proxy's five-digit 0.33333.)
func Probability(n int) string {
	return SavedProbability(strconv.FormatFloat(1/float64(n), 'f', 10, 64))
}

// SavedProbability is how iptables-save prints a --probability that was given as text: xt_statistic
// stores lround(p * 2^31) and libxt_statistic prints that over 2^31 with %.11f.
func SavedProbability(given string) string {
	p, err := strconv.ParseFloat(given, 64)
	if err != nil {
		return given
	}
	stored := math.Round(p * 0x80000000)
	return strconv.FormatFloat(stored/0x80000000, 'f', 11, 64)
}
