package observe

import (
	"encoding/json"
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Address plan (data only, nothing is sent): clients 10.0.1.5 and 10.0.2.9 (pods), 192.168.0.1
// (outside); service addresses 10.96.0.10:80, 10.96.0.53:53, 10.96.0.20:443; endpoints
// 10.244.1.7:8080 (default/web-abc on node-b), 10.244.2.3:53 (kube-system/coredns-x on node-a).
var (
	webPort  = &flow.Port{Namespace: "default", Service: "web", Port: "http", Protocol: flow.TCP, Path: flow.PathSocket, Node: "node-a"}
	dnsPort  = &flow.Port{Namespace: "kube-system", Service: "dns", Port: "dns", Protocol: flow.UDP, Path: flow.PathSocket, Node: "node-a"}
	kernPort = &flow.Port{Namespace: "default", Service: "api", Protocol: flow.TCP, Path: flow.PathKernel, Node: "node-a"}
)

// fakeResolver names the pods of the address plan and counts its calls.
type fakeResolver struct {
	endpointCalls, clientCalls int
}

func (r *fakeResolver) Endpoint(_ *flow.Port, ep netip.AddrPort) (pod, node string) {
	r.endpointCalls++
	switch ep.Addr().String() {
	case "10.244.1.7":
		return "default/web-abc", "node-b"
	case "10.244.2.3":
		return "kube-system/coredns-x", "node-a"
	}
	return "", ""
}

func (r *fakeResolver) Client(ip netip.Addr) string {
	r.clientCalls++
	switch ip.String() {
	case "10.0.1.5":
		return "default/client-1"
	case "10.0.2.9":
		return "kube-system/probe"
	}
	return ""
}

// filterEvents are one event per port: web (start), dns (end, unreachable), api kernel (start).
func filterEvents() map[string]*flow.Event {
	ap := netip.MustParseAddrPort
	return map[string]*flow.Event{
		"web": {Phase: flow.PhaseStart, ID: 1, Port: webPort, Local: ap("10.96.0.10:80"),
			Info: flow.Info{Client: ap("10.0.1.5:40000"), Endpoint: ap("10.244.1.7:8080")}},
		"dns": {Phase: flow.PhaseEnd, ID: 2, Port: dnsPort, Local: ap("10.96.0.53:53"),
			Info: flow.Info{Client: ap("10.0.2.9:5353"), Endpoint: ap("10.244.2.3:53"), End: flow.EndpointRefused}},
		"api": {Phase: flow.PhaseStart, ID: 3, Port: kernPort, Local: ap("10.96.0.20:443"),
			Info: flow.Info{Client: ap("192.168.0.1:1234")}},
	}
}

func TestFilterMatch(t *testing.T) {
	for _, tc := range []struct {
		query string
		want  string // the events passing, in the order web dns api
	}{
		{"", "web dns api"},
		{"namespace=default", "web api"},
		{"namespace=default&namespace=kube-system", "web dns api"},
		{"namespace=default,kube-system", "web dns api"},
		{"service=web", "web"},
		{"service=default/web", "web"},
		{"service=other/web", ""},
		{"service=dns&service=web", "web dns"},
		{"pod=default/web", "web"},        // the endpoint's pod
		{"pod=default/client", "web"},     // the client's pod
		{"pod=kube-system/", "dns"},       // both pods of dns
		{"client=10.0.0.0/16", "web dns"}, // CIDR
		{"client=192.168.0.1", "api"},     // one address
		{"client=::ffff:10.0.1.5", "web"}, // IPv4-mapped, as the data path may not write it
		{"client=::ffff:10.0.0.0/112", "web dns"},
		{"port=80", "web"},   // the service address's port
		{"port=8080", "web"}, // the endpoint's port
		{"port=53", "dns"},
		{"port=dns", "dns"}, // the port's name
		{"port=http&port=443", "web api"},
		{"protocol=udp", "dns"},
		{"protocol=TCP", "web api"},
		{"verdict=unreachable", "dns"},
		{"verdict=kernel", "api"},
		{"verdict=forwarded", "web"},
		{"phase=end", "dns"},
		{"phase=start", "web api"},
		{"node=node-b", "web"},         // the endpoint's node
		{"node=node-a", "web dns api"}, // the proxy's node
		{"path=kernel", "api"},
		{"not-namespace=default", "dns"},
		{"namespace=default&not-path=kernel", "web"}, // keys are AND'ed
		{"namespace=default&protocol=udp", ""},
		{"not-pod=default/web-abc&not-verdict=kernel", "dns"}, // any deny drops
		{"not-client=10.0.1.0/24,192.168.0.0/16", "dns"},
	} {
		t.Run(tc.query, func(t *testing.T) {
			q, err := url.ParseQuery(tc.query)
			if err != nil {
				t.Fatal(err)
			}
			f, err := ParseFilter(q)
			if err != nil {
				t.Fatalf("ParseFilter(%q): %v", tc.query, err)
			}
			evs := filterEvents()
			var got []string
			for _, name := range []string{"web", "dns", "api"} {
				if f.Match(evs[name], &fakeResolver{}) {
					got = append(got, name)
				}
			}
			if diff := cmp.Diff(tc.want, strings.Join(got, " ")); diff != "" {
				t.Errorf("%q passes (-want +got):\n%s", tc.query, diff)
			}
		})
	}
}

func TestFilterParseErrors(t *testing.T) {
	for _, tc := range []struct {
		query string
		want  string // in the error
	}{
		{"verdict=nope", `parameter verdict: unknown verdict "nope"`},
		{"not-phase=bogus", `parameter not-phase: unknown phase "bogus"`},
		{"client=10.0.0.0/33", `parameter client: "10.0.0.0/33": want an IP address or CIDR`},
		{"client=foo", `parameter client: "foo": want an IP address or CIDR`},
		{"port=70000", `parameter port: "70000": want a port number (1-65535) or a port name`},
		{"port=0", `parameter port: "0": want a port number`},
		{"protocol=sctp", `parameter protocol: "sctp": want tcp or udp`},
		{"path=fast", `parameter path: "fast": want socket or kernel`},
		{"service=/web", `parameter service: "/web": want namespace/name or name`},
		{"service=a/b/c", `parameter service: "a/b/c": want namespace/name or name`},
		{"pod=", `parameter pod: empty value`},
		{"namespace=default,", `parameter namespace: empty value`},
		{"nosuch=1", `unknown parameter "nosuch"`},
		{"not-follow=1", `unknown parameter "not-follow"`},
	} {
		t.Run(tc.query, func(t *testing.T) {
			q, err := url.ParseQuery(tc.query)
			if err != nil {
				t.Fatal(err)
			}
			_, err = ParseFilter(q)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ParseFilter(%q) = %v, want an error with %q", tc.query, err, tc.want)
			}
		})
	}
}

// The Resolver is asked once per event however many keys need a pod, and not at all when none
// does.
func TestFilterResolvesOnce(t *testing.T) {
	for _, tc := range []struct {
		query string
		calls int
	}{
		{"service=web", 0},
		{"pod=default/&node=node-b&not-pod=x/", 1},
	} {
		q, _ := url.ParseQuery(tc.query)
		f, err := ParseFilter(q)
		if err != nil {
			t.Fatal(err)
		}
		r := &fakeResolver{}
		v := view{e: filterEvents()["web"], r: r}
		f.match(&v)
		if r.endpointCalls != tc.calls || r.clientCalls != tc.calls {
			t.Errorf("%q: resolver asked endpoint %d, client %d times, want %d each", tc.query, r.endpointCalls, r.clientCalls, tc.calls)
		}
		var it Item
		if err := json.Unmarshal(appendFlowItem(nil, &v), &it); err != nil {
			t.Fatal(err)
		}
		if got := it.Flow; got.EndpointPod != "default/web-abc" || got.ClientPod != "default/client-1" || got.EndpointNode != "node-b" {
			t.Errorf("%q: flow names pods %q %q %q", tc.query, got.EndpointPod, got.EndpointNode, got.ClientPod)
		}
		if r.endpointCalls != 1 {
			t.Errorf("%q: after the flow, resolver asked %d times, want 1", tc.query, r.endpointCalls)
		}
	}
}

// A dual-stack listener sees IPv4 clients as IPv4-mapped IPv6 addresses: an IPv4 filter still
// matches them.
func TestFilterClientMapped(t *testing.T) {
	e := filterEvents()["web"]
	e.Client = netip.MustParseAddrPort("[::ffff:10.0.1.5]:40000")
	for _, q := range []string{"client=10.0.1.0/24", "client=10.0.1.5", "client=::ffff:10.0.1.5"} {
		v, _ := url.ParseQuery(q)
		f, err := ParseFilter(v)
		if err != nil {
			t.Fatal(err)
		}
		if !f.Match(e, nil) {
			t.Errorf("%s does not match client %v", q, e.Client)
		}
	}
}
