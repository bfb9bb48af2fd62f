package observe

import (
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// podsOf resolves the endpoint 10.244.1.5 to a pod on node-b and the client 10.244.0.7 to a pod.
type podsOf struct{}

func (podsOf) Endpoint(_ *flow.Port, ep netip.AddrPort) (string, string) {
	if ep.Addr() == netip.MustParseAddr("10.244.1.5") {
		return "shop/web-1", "node-b"
	}
	return "", ""
}

func (podsOf) Client(ip netip.Addr) string {
	if ip.Unmap() == netip.MustParseAddr("10.244.0.7") {
		return "shop/client-0"
	}
	return ""
}

// TestFilterKeys checks every key's parsing and matching on two events: a forwarded TCP flow of
// shop/web:http from a pod, and a refused UDP flow of kube-system/dns on the kernel path.
func TestFilterKeys(t *testing.T) {
	web := &flow.Event{
		Phase: flow.PhaseEnd,
		Port:  &flow.Port{Namespace: "shop", Service: "web", Port: "http", Protocol: flow.TCP, Node: "node-a"},
		Local: netip.MustParseAddrPort("10.96.0.10:80"),
		Info: flow.Info{
			Client:   netip.MustParseAddrPort("[::ffff:10.244.0.7]:40000"),
			Endpoint: netip.MustParseAddrPort("10.244.1.5:8080"),
			End:      flow.ClientClosed,
		},
	}
	dns := &flow.Event{
		Phase: flow.PhaseStart,
		Port:  &flow.Port{Namespace: "kube-system", Service: "dns", Protocol: flow.UDP, Path: flow.PathKernel, Node: "node-c"},
		Local: netip.MustParseAddrPort("10.96.0.53:53"),
		Info:  flow.Info{Client: netip.MustParseAddrPort("192.168.1.9:5000")},
	}
	for _, tc := range []struct {
		query    string
		web, dns bool
	}{
		{"", true, true},
		{"namespace=shop", true, false},
		{"namespace=shop,kube-system", true, true},
		{"not-namespace=shop", false, true},
		{"service=web", true, false},
		{"service=shop/web", true, false},
		{"service=other/web", false, false},
		{"service=kube-system/dns&service=web", true, true},
		{"pod=shop/web", true, false},      // the endpoint's pod, by prefix
		{"pod=shop/client-0", true, false}, // the client's pod
		{"pod=shop/db", false, false},
		{"client=10.244.0.0/16", true, false},
		{"client=::ffff:10.244.0.0/112", true, false}, // a mapped prefix matches unmapped clients
		{"client=192.168.1.9", false, true},
		{"port=80", true, false},   // the service port
		{"port=8080", true, false}, // the endpoint's
		{"port=53", false, true},
		{"port=http", true, false},
		{"protocol=TCP", true, false},
		{"protocol=udp", false, true},
		{"not-protocol=udp", true, false},
		{"verdict=forwarded", true, false},
		{"verdict=kernel", false, true},
		{"phase=start", false, true},
		{"phase=end", true, false},
		{"node=node-a", true, false}, // the proxy's node
		{"node=node-b", true, false}, // the endpoint's node
		{"node=node-c", false, true},
		{"path=socket", true, false},
		{"path=Kernel", false, true},
		{"namespace=shop&protocol=udp", false, false},
	} {
		q, err := url.ParseQuery(tc.query)
		if err != nil {
			t.Fatal(err)
		}
		f, err := ParseFilter(q)
		if err != nil {
			t.Errorf("%s: %v", tc.query, err)
			continue
		}
		if got := f.Match(web, podsOf{}); got != tc.web {
			t.Errorf("%s: web matched %v, want %v", tc.query, got, tc.web)
		}
		if got := f.Match(dns, podsOf{}); got != tc.dns {
			t.Errorf("%s: dns matched %v, want %v", tc.query, got, tc.dns)
		}
	}
}

func TestFilterErrors(t *testing.T) {
	for query, want := range map[string]string{
		"colour=red":        `unknown parameter "colour"`,
		"not-colour=red":    `unknown parameter "not-colour"`,
		"namespace=a,":      "parameter namespace: empty value",
		"service=a/":        `parameter service: "a/": want namespace/name or name`,
		"service=/a":        `parameter service: "/a": want namespace/name or name`,
		"service=a/b/c":     `parameter service: "a/b/c": want namespace/name or name`,
		"client=10.0.0.x":   `parameter client: "10.0.0.x": want an IP address or CIDR`,
		"port=0":            `parameter port: "0": want a port number (1-65535) or a port name`,
		"port=70000":        `parameter port: "70000": want a port number (1-65535) or a port name`,
		"not-protocol=sctp": `parameter not-protocol: "sctp": want tcp or udp`,
		"path=fast":         `parameter path: "fast": want socket or kernel`,
		"verdict=fine":      `parameter verdict: unknown verdict "fine"`,
		"phase=middle":      "parameter phase: ",
		"namespace=a&zz=1":  `unknown parameter "zz"`,
	} {
		q, err := url.ParseQuery(query)
		if err != nil {
			t.Fatal(err)
		}
		_, err = ParseFilter(q)
		if err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("%s: error %v, want one starting %q", query, err, want)
		}
	}
}

func TestFilterKeysListed(t *testing.T) {
	got := strings.Join(FilterKeys(), ",")
	if want := "namespace,service,pod,client,port,protocol,verdict,phase,node,path"; got != want {
		t.Errorf("FilterKeys() = %s, want %s", got, want)
	}
}
