package observe

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestCaptureSelectsFlowsWhateverThePhaseFilter: a capture is decided on the flow's Dial event,
// and observe --pcap asks for End events only (phase=end, its default): its filter's phase terms
// must not keep it from capturing the flows the rest of its filter selects, while the rest still
// chooses. (Before, phase=end failed on the Dial event and such a capture got no payload at all.)
func TestCaptureSelectsFlowsWhateverThePhaseFilter(t *testing.T) {
	port := &flow.Port{Namespace: "default", Service: "web", Port: "http", Protocol: flow.TCP, Path: flow.PathSocket, Node: "n1"}
	dial := func(id uint64) *flow.Event {
		return &flow.Event{Phase: flow.PhaseDial, ID: id, Time: time.Now(), Port: port,
			Info: flow.Info{Client: netip.MustParseAddrPort("10.0.0.1:40000"), Endpoint: netip.MustParseAddrPort("10.1.0.5:8080")}}
	}
	for _, c := range []struct {
		query string
		want  bool
	}{
		{"phase=end", true},
		{"phase=end&service=default/web", true},
		{"not-phase=dial&service=web", true},
		{"phase=end&service=default/other", false},
		{"phase=end&not-service=default/web", false},
	} {
		t.Run(c.query, func(t *testing.T) {
			h := NewHub(HubConfig{Capture: true})
			srv := httptest.NewServer(h.Handler(nil))
			defer srv.Close()
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/debug/flows?follow=1&capture=1&"+c.query, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("GET: %s", resp.Status)
			}
			testenv.WaitFor(t, "the capturing observer to subscribe", func() bool { return h.Stats().Captures == 1 })

			rec := h.ForPort(port)
			e := dial(1)
			rec.Record(e)
			tap := rec.(flow.Capturer).Capture(e)
			if got := tap != nil; got != c.want {
				t.Fatalf("Capture on the Dial event with %s: tapped %v, want %v", c.query, got, c.want)
			}
			if tap != nil {
				tap.Close()
			}
		})
	}
}
