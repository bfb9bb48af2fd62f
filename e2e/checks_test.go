package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// requestTimeout bounds one request through a portal.
const requestTimeout = 2 * time.Second

// eventually waits up to timeout for f to succeed, failing t with what and f's last error.
func eventually(t *testing.T, timeout time.Duration, what string, f func() error) {
	t.Helper()
	if err := testbed.Eventually(t.Context(), timeout, 100*time.Millisecond, f); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// whoTCP and whoUDP ask the backend behind addr, seen from ns, for its pod name.
func whoTCP(ns *netns.NS, addr netip.AddrPort) (string, error) {
	return testbed.Who(ns, addr, requestTimeout)
}

func whoUDP(ns *netns.NS, addr netip.AddrPort) (string, error) {
	return testbed.WhoUDP(ns, addr, requestTimeout)
}

type asker func(*netns.NS, netip.AddrPort) (string, error)

// tally sends n requests and counts the answering pods; any failed request fails t.
func tally(t *testing.T, ask asker, from *netns.NS, addr netip.AddrPort, n int) map[string]int {
	t.Helper()
	seen := map[string]int{}
	for i := range n {
		who, err := ask(from, addr)
		if err != nil {
			t.Fatalf("request %d/%d from %s to %s: %v (answers so far: %v)", i+1, n, from.Name, addr, err, seen)
		}
		seen[who]++
	}
	return seen
}

// tallyUDP sends one query from each of n sockets, all open at once so that each has its own
// source port and hence its own session, and counts the answering pods.
func tallyUDP(t *testing.T, from *netns.NS, addr netip.AddrPort, n int) map[string]int {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range n {
		var c net.Conn
		if err := from.Do(func() (err error) {
			c, err = net.Dial("udp", addr.String())
			return err
		}); err != nil {
			t.Fatalf("UDP socket in %s: %v", from.Name, err)
		}
		conns = append(conns, c)
	}
	seen := map[string]int{}
	for i, c := range conns {
		who, err := testbed.Ask(c, fmt.Sprintf("query-%d", i), requestTimeout)
		if err != nil {
			t.Fatalf("query %d/%d from %s to %s: %v (answers so far: %v)", i+1, n, from.Name, addr, err, seen)
		}
		seen[who]++
	}
	return seen
}

// podNames are the names of pods i (1-based), as the backends greet.
func podNames(pods ...int) []string {
	var out []string
	for _, i := range pods {
		out = append(out, fmt.Sprintf("pod%d", i))
	}
	return out
}

// keys returns the sorted keys of a tally.
func keys(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// nodeHTTP is an HTTP client whose connections are made inside ns.
func nodeHTTP(ns *netns.NS) *http.Client {
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				var c net.Conn
				err := ns.Do(func() (err error) {
					c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
					return err
				})
				return c, err
			},
		},
	}
}

// httpGet fetches url from inside ns.
func httpGet(ns *netns.NS, url string) (int, string, error) {
	resp, err := nodeHTTP(ns).Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(body), err
}

// checkHealthy asserts /healthz and /livez answer 200 and /healthz reports a sync.
func checkHealthy(t *testing.T, ns *netns.NS) {
	t.Helper()
	for _, path := range []string{"/healthz", "/livez"} {
		code, body, err := httpGet(ns, "http://"+healthzAddr+path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		if code != http.StatusOK {
			t.Errorf("GET %s = %d %s, want 200", path, code, body)
		}
		var status struct {
			LastUpdated time.Time `json:"lastUpdated"`
		}
		if err := json.Unmarshal([]byte(body), &status); err != nil {
			t.Errorf("GET %s: body %q: %v", path, body, err)
		} else if status.LastUpdated.IsZero() {
			t.Errorf("GET %s: lastUpdated is zero after a sync: %s", path, body)
		}
	}
}

// The chains the proxy owns; none may be left after --cleanup.
var ownedChains = []string{"KUBE-PORTALS-CONTAINER", "KUBE-PORTALS-HOST", "KUBE-NODEPORT-CONTAINER",
	"KUBE-NODEPORT-HOST", "KUBE-NODEPORT-NON-LOCAL", "KUBE-PORTALS-GUARD",
	// The kernel data path's (portal/kernel): top-level chains and the per-port prefixes.
	"KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ",
	"KUBE-FORWARD", "KUBE-PROXY-FIREWALL", "KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-",
	// An earlier build's iptables mark of the transparent source mode (portal/transparent.LegacyChain;
	// the mode marks with an nft table now, transparentPlumbing checks it).
	"KUBE-PORTALS-TRANSPARENT"}

// ruleSet is the output of iptables-save (or ip6tables-save) -c: the "-A" rule lines, each with
// its table and packet counter.
type ruleSet []rule

type rule struct {
	table   string
	text    string // "-A CHAIN ..."
	packets uint64
}

var counterPrefix = regexp.MustCompile(`^\[(\d+):\d+\] `)

// saveRules runs iptables-save -c (or ip6tables-save -c) in ns.
func saveRules(t *testing.T, ns *netns.NS, tool string) (ruleSet, string) {
	t.Helper()
	out, err := ns.Exec(t.Context(), tool, "-c")
	if err != nil {
		t.Fatalf("%s in %s: %v", tool, ns.Name, err)
	}
	var rs ruleSet
	table := ""
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "*") {
			table = line[1:]
			continue
		}
		var packets uint64
		if m := counterPrefix.FindStringSubmatch(line); m != nil {
			packets, _ = strconv.ParseUint(m[1], 10, 64)
			line = line[len(m[0]):]
		}
		if strings.HasPrefix(line, "-A ") {
			rs = append(rs, rule{table: table, text: line, packets: packets})
		}
	}
	return rs, string(out)
}

// rules runs iptables-save -c in ns.
func rules(t *testing.T, ns *netns.NS) ruleSet {
	t.Helper()
	rs, _ := saveRules(t, ns, "iptables-save")
	return rs
}

// of returns the rules whose comment names a service port of Kubernetes namespace k8sNamespace
// (the proxy comments every portal rule with "namespace/name:port").
func (rs ruleSet) of(k8sNamespace string) ruleSet {
	var out ruleSet
	for _, r := range rs {
		if strings.Contains(r.text, `--comment "`+k8sNamespace+`/`) {
			out = append(out, r)
		}
	}
	return out
}

// in returns the rules of a chain.
func (rs ruleSet) in(chain string) ruleSet {
	var out ruleSet
	for _, r := range rs {
		if strings.HasPrefix(r.text, "-A "+chain+" ") {
			out = append(out, r)
		}
	}
	return out
}

// packets sums the packet counters.
func (rs ruleSet) packets() uint64 {
	var n uint64
	for _, r := range rs {
		n += r.packets
	}
	return n
}

// texts returns the rule lines, "table: -A ...", in order.
func (rs ruleSet) texts() []string {
	out := make([]string, 0, len(rs))
	for _, r := range rs {
		out = append(out, r.table+": "+r.text)
	}
	return out
}

// duplicates returns the rule lines that appear more than once in the same table.
func (rs ruleSet) duplicates() []string {
	seen := map[string]int{}
	var dups []string
	for _, line := range rs.texts() {
		seen[line]++
		if seen[line] == 2 {
			dups = append(dups, line)
		}
	}
	return dups
}

var toPorts = regexp.MustCompile(`(?:--to-ports |--to-destination [0-9.]+:)(\d+)`)

// proxyPorts returns the local ports the rules send traffic to.
func (rs ruleSet) proxyPorts() []uint16 {
	var out []uint16
	for _, r := range rs {
		if m := toPorts.FindStringSubmatch(r.text); m != nil {
			p, _ := strconv.ParseUint(m[1], 10, 16)
			if !slices.Contains(out, uint16(p)) {
				out = append(out, uint16(p))
			}
		}
	}
	slices.Sort(out)
	return out
}

// listening returns the TCP and UDP ports with a socket bound in ns (ss -Hlntu).
func listening(t *testing.T, ns *netns.NS) map[uint16]bool {
	t.Helper()
	out, err := ns.Exec(t.Context(), "ss", "-Hlntu")
	if err != nil {
		t.Fatalf("ss in %s: %v", ns.Name, err)
	}
	ports := map[uint16]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		i := strings.LastIndex(f[4], ":")
		if p, err := strconv.ParseUint(f[4][i+1:], 10, 16); err == nil {
			ports[uint16(p)] = true
		}
	}
	return ports
}

// dialTCP opens a TCP connection from ns.
func dialTCP(ns *netns.NS, addr netip.AddrPort) (net.Conn, error) {
	return testbed.Dial(ns, addr, requestTimeout)
}
