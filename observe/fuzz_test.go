package observe

import (
	"net/http"
	"net/netip"
	"net/url"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// FuzzParseRequest: any query string a client sends to /debug/flows is parsed without a panic;
// one that parses gives a filter that can be matched against any event, and one that does not
// names a parameter in its error.
func FuzzParseRequest(f *testing.F) {
	for _, q := range []string{
		"follow=1&last=10&since=5m&namespace=demo&service=demo/web",
		"verdict=reset,dial-failed&not-verdict=forwarded&phase=end&client=10.0.0.0/8",
		"pod=demo/web-&port=80&port=http&protocol=udp&node=a&path=kernel",
		"capture=1&capture_bytes=100&rate=5&format=sse",
		"since=2026-11-27T18:00:00Z&not-client=::1&not-pod=x",
		"last=-3", "rate=abc", "client=300.1.1.1/40", "verdict=", "zzz=1", "follow=1&follow=1",
	} {
		f.Add(q)
	}
	hub := NewHub(HubConfig{RingSize: 4, Capture: true})
	events := []*flow.Event{
		{Phase: flow.PhaseEnd, Port: &flow.Port{Namespace: "demo", Service: "web", Port: "http"},
			Info: flow.Info{Client: netip.MustParseAddrPort("10.0.0.1:3000"), Endpoint: netip.MustParseAddrPort("10.244.1.1:8080"), End: flow.ClientReset}},
		{Phase: flow.PhaseStart, Port: &flow.Port{Namespace: "x", Service: "dns", Protocol: flow.UDP, Path: flow.PathKernel},
			Local: netip.MustParseAddrPort("[fd00::10]:53"), Info: flow.Info{Client: netip.MustParseAddrPort("[fd00::1]:4000")}},
		{},
	}
	f.Fuzz(func(t *testing.T, query string) {
		if _, err := url.ParseQuery(query); err != nil {
			return // net/http would hand the handler the same values; not ours to parse
		}
		r := &http.Request{Method: http.MethodGet, URL: &url.URL{Path: "/debug/flows", RawQuery: query}}
		req, err := hub.parseRequest(r)
		if err != nil {
			if err.Error() == "" {
				t.Fatalf("query %q: empty error", query)
			}
			return
		}
		for _, e := range events {
			e.Time = time.Unix(1_800_000_000, 0)
			req.filter.Match(e, nil)
		}
	})
}
