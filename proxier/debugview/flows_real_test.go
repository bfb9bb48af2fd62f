package debugview

// Address plan: the debug server is an httptest server on 127.0.0.1. The flows are events the
// test records into a real observe.Hub; their addresses (10.96.0.x service IPs, 10.244.x pods and
// clients) are values in the events only: no socket uses them.

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// realFlows serves /debug/flows with the real hub handler. The first request is the page's
// EventSource: once the hub has subscribed it (its first flush comes after the subscription and
// the choice of where to start), record writes the test's events into the hub; once want
// server-sent events went out, the request's context ends, so the stream ends and the browser's
// virtual time can run on (an open stream holds it). Later requests (the EventSource reconnecting)
// get 204, which closes an EventSource for good.
type realFlows struct {
	handler http.Handler
	record  func()
	want    int

	mu    sync.Mutex
	asked []url.Values
	sent  []byte // what the hub wrote on the first request
}

func (f *realFlows) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.asked = append(f.asked, r.URL.Query())
	first := len(f.asked) == 1
	f.mu.Unlock()
	if !first {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	sw := &sseCounter{ResponseWriter: w, owner: f, onFirstFlush: f.record, onEvents: func(n int) {
		if n >= f.want {
			cancel()
		}
	}}
	f.handler.ServeHTTP(sw, r.WithContext(ctx))
}

func (f *realFlows) requests() []url.Values {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]url.Values(nil), f.asked...)
}

func (f *realFlows) written() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return string(f.sent)
}

// sseCounter passes the hub's writes through, keeping a copy and counting the server-sent events
// ("data: ...\n\n") in them.
type sseCounter struct {
	http.ResponseWriter
	owner        *realFlows
	onFirstFlush func()
	onEvents     func(n int)
	flushed      bool
}

func (s *sseCounter) Write(b []byte) (int, error) {
	s.owner.mu.Lock()
	s.owner.sent = append(s.owner.sent, b...)
	n := bytes.Count(s.owner.sent, []byte("\n\n"))
	s.owner.mu.Unlock()
	s.onEvents(n)
	return s.ResponseWriter.Write(b)
}

// Flush is what the hub's http.ResponseController calls.
func (s *sseCounter) Flush() {
	s.ResponseWriter.(http.Flusher).Flush()
	if !s.flushed {
		s.flushed = true
		s.onFirstFlush()
	}
}

// podNames is the Resolver: it names the pods behind the endpoints, as the proxier would from
// its EndpointSlices.
type podNames map[netip.Addr]string

func (p podNames) Endpoint(_ *flow.Port, ep netip.AddrPort) (string, string) {
	return p[ep.Addr()], "node-a"
}
func (p podNames) Client(ip netip.Addr) string { return p[ip] }

// TestLiveFlowsFromRealHubInChromium: the status page's live view against the real
// observe.Hub handler (not a hand-written stream): the browser's EventSource must parse the
// hub's own SSE framing, and the page's filter (service and verdict, phase=end) must narrow the
// real stream. The hub gets, after the page subscribed: two ended flows of ns/echo (forwarded,
// through pods), and three events the filter must drop: ns/echo's start event (phase), a refused
// ns/echo flow (verdict) and a forwarded flow of ns/other (service). Only the two rows may show.
func TestLiveFlowsFromRealHubInChromium(t *testing.T) {
	browser := testenv.Chromium(t)
	hub := observe.NewHub(observe.HubConfig{RingSize: 64, Node: "node-a"})
	echo := hub.ForPort(&flow.Port{Namespace: "ns", Service: "echo", Port: "http", Protocol: flow.TCP, Path: flow.PathSocket, Node: "node-a"})
	other := hub.ForPort(&flow.Port{Namespace: "ns", Service: "other", Port: "http", Protocol: flow.TCP, Path: flow.PathSocket, Node: "node-a"})
	pods := podNames{
		netip.MustParseAddr("10.244.1.5"): "ns/echo-7d9f-abcde",
		netip.MustParseAddr("10.244.1.6"): "ns/echo-7d9f-fghij",
		netip.MustParseAddr("10.244.1.9"): "ns/other-5c4b-klmno",
	}
	at := time.Date(2026, 7, 1, 12, 0, 1, 0, time.UTC)
	ended := func(id uint64, client, endpoint string, end flow.EndReason, d time.Duration, toEp, toCl uint64) *flow.Event {
		e := &flow.Event{Phase: flow.PhaseEnd, ID: id, Time: at.Add(time.Duration(id) * time.Millisecond),
			Local: netip.MustParseAddrPort("10.96.0.7:80")}
		e.Client = netip.MustParseAddrPort(client)
		if endpoint != "" {
			e.Endpoint = netip.MustParseAddrPort(endpoint)
		}
		e.End, e.Duration, e.BytesToEndpoint, e.BytesToClient = end, d, toEp, toCl
		return e
	}
	record := func() {
		start := ended(1, "10.244.2.10:51001", "10.244.1.5:8080", flow.Unknown, 0, 0, 0)
		start.Phase = flow.PhaseStart
		echo.Record(start)
		echo.Record(ended(1, "10.244.2.10:51001", "10.244.1.5:8080", flow.ClientClosed, 12345*time.Microsecond, 78, 1234))
		echo.Record(ended(2, "10.244.2.10:51002", "", flow.NoEndpoints, 0, 0, 0))
		other.Record(ended(3, "10.244.2.10:51003", "10.244.1.9:8080", flow.ClientClosed, time.Millisecond, 5, 5))
		echo.Record(ended(4, "10.244.2.10:51004", "10.244.1.6:8080", flow.EndpointClosed, 2500*time.Microsecond, 10, 20))
	}
	flows := &realFlows{handler: hub.Handler(pods), record: record, want: 2}
	mux := http.NewServeMux()
	Register(mux, sampleSource())
	mux.Handle("/debug/flows", flows)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	dom := testenv.RenderedDOM(t, browser, srv.URL+"/#flows?service=ns/echo&verdict=forwarded")
	reqs := flows.requests()
	if len(reqs) == 0 {
		t.Fatalf("the page never asked /debug/flows; page:\n%s", dom)
	}
	want := url.Values{"follow": {"1"}, "phase": {"end"}, "service": {"ns/echo"}, "verdict": {"forwarded"}}
	if !reflect.DeepEqual(reqs[0], want) {
		t.Errorf("/debug/flows query %v, want %v", reqs[0], want)
	}
	sent := flows.written()
	if !strings.HasPrefix(sent, "data: {") {
		t.Errorf("the hub did not answer in server-sent events; it wrote:\n%s", sent)
	}
	_, live, ok := strings.Cut(dom, `<table id="flows">`)
	if !ok {
		t.Fatalf("no live flows table; page:\n%s", dom)
	}
	for _, want := range []string{
		// Newest first: flow 4, then flow 1, each with its service, endpoint pod and verdict.
		`<td><code>ns/echo:http</code></td><td><code>10.244.2.10:51004</code></td><td><code>10.244.1.6:8080</code></td><td>ns/echo-7d9f-fghij</td><td><span class="v-forwarded">forwarded (endpoint-closed)</span></td><td class="num">2.5ms</td><td class="num">10 / 20</td>`,
		`<td><code>ns/echo:http</code></td><td><code>10.244.2.10:51001</code></td><td><code>10.244.1.5:8080</code></td><td>ns/echo-7d9f-abcde</td><td><span class="v-forwarded">forwarded (client-closed)</span></td><td class="num">12.3ms</td><td class="num">78 / 1234</td>`,
	} {
		if !strings.Contains(live, want) {
			t.Errorf("live flows lack %q; table:\n%s\nthe hub sent:\n%s", want, live, sent)
		}
	}
	for _, gone := range []string{"10.244.2.10:51002", "ns/other", "10.244.1.9"} {
		if strings.Contains(live, gone) {
			t.Errorf("live flows show %q, which the filter drops; table:\n%s", gone, live)
		}
	}
	if i, j := strings.Index(live, "10.244.2.10:51004"), strings.Index(live, "10.244.2.10:51001"); i < 0 || j < 0 || i > j {
		t.Errorf("rows not newest first; table:\n%s", live)
	}
	if !strings.Contains(dom, `<span id="flows-count">2</span>`) {
		t.Errorf("flow count is not 2; page:\n%s", dom)
	}
}
