package observe

import (
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// FilterKeys lists the allow filters /debug/flows takes; each also exists as a deny filter,
// prefixed DenyPrefix.
func FilterKeys() []string {
	keys := make([]string, len(termParsers))
	for i, t := range termParsers {
		keys[i] = t.key
	}
	return keys
}

// DenyPrefix turns an allow filter's key into the deny filter's.
const DenyPrefix = "not-"

// Filter selects events. An event passes when, for every allow key given, it matches one of the
// key's values, and it matches no deny value at all. The zero Filter passes everything.
type Filter struct {
	allow, deny []term
	// phases has bit 1<<p set for each phase p the filter may pass: the ring skips the others
	// without copying them out (most observers ask for the end of each flow only).
	phases uint8
}

// term is one key's values: match reports whether the event matches any of them.
type term struct {
	key   string
	match func(v *view) bool
	// phase: the term picks which of a flow's events to send, not which flows (matchFlow).
	phase bool
}

// phaseMask is the phases a phase term lets through: the values named (or all but those, for a
// deny term). The values were checked by parseTerm.
func phaseMask(values []string, deny bool) uint8 {
	var m uint8
	for _, v := range values {
		if p, err := flow.ParsePhase(v); err == nil {
			m |= 1 << p
		}
	}
	if deny {
		return ^m
	}
	return m
}

// ParseFilter reads the filter parameters of q (FilterKeys and their DenyPrefix forms). Values of
// a key may repeat or be comma-separated. Any other key is an error, as is a bad value; the
// error names the parameter and the value.
func ParseFilter(q url.Values) (*Filter, error) {
	keys := make([]string, 0, len(q))
	for k := range q {
		keys = append(keys, k)
	}
	slices.Sort(keys) // the first bad parameter named is the same each time
	f := &Filter{phases: 1<<flow.NumPhases - 1}
	for _, k := range keys {
		base, deny := strings.CutPrefix(k, DenyPrefix)
		if !slices.Contains(FilterKeys(), base) {
			return nil, fmt.Errorf("unknown parameter %q", k)
		}
		var values []string
		for _, v := range q[k] {
			for s := range strings.SplitSeq(v, ",") {
				values = append(values, strings.TrimSpace(s))
			}
		}
		m, err := parseTerm(base, values)
		if err != nil {
			return nil, fmt.Errorf("parameter %s: %w", k, err)
		}
		t := term{key: k, match: m, phase: base == "phase"}
		if t.phase {
			f.phases &= phaseMask(values, deny)
		}
		if deny {
			f.deny = append(f.deny, t)
		} else {
			f.allow = append(f.allow, t)
		}
	}
	return f, nil
}

// Match reports whether e passes f; r (nil: none) names pods for the pod and node keys.
func (f *Filter) Match(e *flow.Event, r Resolver) bool {
	v := view{e: e, r: r}
	return f.match(&v)
}

func (f *Filter) match(v *view) bool { return f.matchTerms(v, true) }

// matchFlow is match without the phase terms: whether the flow of v's event is one the filter
// selects. A capture is decided on one early event (TCP Dial, UDP Start) for the whole flow, and
// an observer that prints only End events (observe's default) still wants its flows' payload.
func (f *Filter) matchFlow(v *view) bool { return f.matchTerms(v, false) }

func (f *Filter) matchTerms(v *view, phases bool) bool {
	if f == nil {
		return true
	}
	for _, t := range f.allow {
		if (phases || !t.phase) && !t.match(v) {
			return false
		}
	}
	for _, t := range f.deny {
		if (phases || !t.phase) && t.match(v) {
			return false
		}
	}
	return true
}

// view is an event seen by one observer: the pods behind its addresses are resolved at most
// once, when a filter or the stream first needs them, on the observer's goroutine.
type view struct {
	e        *flow.Event
	r        Resolver
	resolved bool
	// The Resolver's answers: the endpoint's pod and node, the client's pod.
	endpointPod, endpointNode, clientPod string
}

func (v *view) resolve() {
	if v.resolved {
		return
	}
	v.resolved = true
	if ref := v.e.Pick.Ref; ref != nil { // named by the balancer at the pick: still right after the pod left
		v.endpointPod, v.endpointNode = ref.Pod, ref.Node
	}
	if v.r == nil {
		return
	}
	if v.e.Endpoint.IsValid() && v.e.Pick.Ref == nil {
		v.endpointPod, v.endpointNode = v.r.Endpoint(v.e.Port, v.e.Endpoint)
	}
	if v.e.Client.IsValid() {
		v.clientPod = v.r.Client(v.e.Client.Addr())
	}
}

var errEmpty = errors.New("empty value")

// termParsers are the filter keys, in the order FilterKeys lists them, each with the parser
// that builds the matcher of its values (none empty).
var termParsers = []struct {
	key   string
	parse func(values []string) (func(*view) bool, error)
}{
	{"namespace", namespaceTerm},
	{"service", serviceTerm},
	{"pod", podTerm},
	{"client", clientTerm},
	{"port", portTerm},
	{"protocol", protocolTerm},
	{"verdict", verdictTerm},
	{"phase", phaseTerm},
	{"node", nodeTerm},
	{"path", pathTerm},
}

// parseTerm builds the matcher of one key's values.
func parseTerm(key string, values []string) (func(*view) bool, error) {
	for _, s := range values {
		if s == "" {
			return nil, errEmpty
		}
	}
	for _, t := range termParsers {
		if t.key == key {
			return t.parse(values)
		}
	}
	return nil, fmt.Errorf("unknown filter %q", key)
}

func namespaceTerm(values []string) (func(*view) bool, error) {
	return func(v *view) bool {
		return v.e.Port != nil && slices.Contains(values, v.e.Port.Namespace)
	}, nil
}

func serviceTerm(values []string) (func(*view) bool, error) {
	type name struct{ ns, name string } // ns "": any namespace
	names := make([]name, len(values))
	for i, s := range values {
		ns, n, ok := strings.Cut(s, "/")
		if !ok {
			ns, n = "", s
		}
		if (ok && ns == "") || n == "" || strings.Contains(n, "/") {
			return nil, fmt.Errorf("%q: want namespace/name or name", s)
		}
		names[i] = name{ns, n}
	}
	return func(v *view) bool {
		p := v.e.Port
		if p == nil {
			return false
		}
		for _, n := range names {
			if n.name == p.Service && (n.ns == "" || n.ns == p.Namespace) {
				return true
			}
		}
		return false
	}, nil
}

// podTerm matches a prefix of either pod, the endpoint's or the client's.
func podTerm(values []string) (func(*view) bool, error) {
	return func(v *view) bool {
		v.resolve()
		for _, s := range values {
			if (v.endpointPod != "" && strings.HasPrefix(v.endpointPod, s)) ||
				(v.clientPod != "" && strings.HasPrefix(v.clientPod, s)) {
				return true
			}
		}
		return false
	}, nil
}

func clientTerm(values []string) (func(*view) bool, error) {
	prefixes := make([]netip.Prefix, len(values))
	for i, s := range values {
		p, err := parsePrefix(s)
		if err != nil {
			return nil, err
		}
		prefixes[i] = p
	}
	return func(v *view) bool {
		if !v.e.Client.IsValid() {
			return false
		}
		a := v.e.Client.Addr().Unmap()
		for _, p := range prefixes {
			if p.Contains(a) {
				return true
			}
		}
		return false
	}, nil
}

// portTerm matches a number against the service port and the endpoint's port, a name against
// the service port's name.
func portTerm(values []string) (func(*view) bool, error) {
	var numbers []uint16
	var names []string
	for _, s := range values {
		if n, err := strconv.ParseUint(s, 10, 16); err == nil && n > 0 {
			numbers = append(numbers, uint16(n))
		} else if s[0] >= '0' && s[0] <= '9' {
			return nil, fmt.Errorf("%q: want a port number (1-65535) or a port name", s)
		} else {
			names = append(names, s)
		}
	}
	return func(v *view) bool {
		e := v.e
		for _, n := range numbers {
			if (e.Local.IsValid() && e.Local.Port() == n) || (e.Endpoint.IsValid() && e.Endpoint.Port() == n) {
				return true
			}
		}
		return e.Port != nil && e.Port.Port != "" && slices.Contains(names, e.Port.Port)
	}, nil
}

func protocolTerm(values []string) (func(*view) bool, error) {
	set, err := nameSet(values, map[string]int{"tcp": int(flow.TCP), "udp": int(flow.UDP)}, "want tcp or udp")
	if err != nil {
		return nil, err
	}
	return func(v *view) bool {
		return v.e.Port != nil && int(v.e.Port.Protocol) < len(set) && set[v.e.Port.Protocol]
	}, nil
}

func pathTerm(values []string) (func(*view) bool, error) {
	set, err := nameSet(values, map[string]int{"socket": int(flow.PathSocket), "kernel": int(flow.PathKernel)}, "want socket or kernel")
	if err != nil {
		return nil, err
	}
	return func(v *view) bool {
		return v.e.Port != nil && int(v.e.Port.Path) < len(set) && set[v.e.Port.Path]
	}, nil
}

// nameSet reads case-insensitive names of two values (numbers 0 and 1) into a set; an unknown
// name is an error that says want.
func nameSet(values []string, names map[string]int, want string) ([2]bool, error) {
	var set [2]bool
	for _, s := range values {
		x, ok := names[strings.ToLower(s)]
		if !ok {
			return set, fmt.Errorf("%q: %s", s, want)
		}
		set[x] = true
	}
	return set, nil
}

func verdictTerm(values []string) (func(*view) bool, error) {
	var set [flow.NumVerdicts]bool
	for _, s := range values {
		x, err := flow.ParseVerdict(s)
		if err != nil {
			return nil, err
		}
		set[x] = true
	}
	return func(v *view) bool { x := v.e.Verdict(); return x < flow.NumVerdicts && set[x] }, nil
}

func phaseTerm(values []string) (func(*view) bool, error) {
	var set [flow.NumPhases]bool
	for _, s := range values {
		x, err := flow.ParsePhase(s)
		if err != nil {
			return nil, err
		}
		set[x] = true
	}
	return func(v *view) bool { return v.e.Phase < flow.NumPhases && set[v.e.Phase] }, nil
}

// nodeTerm matches either node: the proxy's (useful when merging nodes) or the endpoint's (which
// pods on a node a proxy sends to), as pod matches either pod.
func nodeTerm(values []string) (func(*view) bool, error) {
	return func(v *view) bool {
		if v.e.Port != nil && slices.Contains(values, v.e.Port.Node) {
			return true
		}
		v.resolve()
		return v.endpointNode != "" && slices.Contains(values, v.endpointNode)
	}, nil
}

// parsePrefix reads a CIDR or a single address.
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q: want an IP address or CIDR: %w", s, err)
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			// Events carry IPv4 clients unmapped.
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q: want an IP address or CIDR: %w", s, err)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}
