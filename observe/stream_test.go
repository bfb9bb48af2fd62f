package observe

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// The stream tests serve the hub on a loopback httptest server and read it as the CLI does.
// Events follow the address plan in filter_test.go.

func serveHub(t *testing.T, h *Hub) string {
	t.Helper()
	srv := httptest.NewServer(h.Handler(&lockedResolver{}))
	t.Cleanup(srv.Close) // runs after the streams' cleanups have ended their requests
	return srv.URL + "/debug/flows"
}

// lockedResolver is fakeResolver for concurrent observers.
type lockedResolver struct {
	mu sync.Mutex
	r  fakeResolver
}

func (l *lockedResolver) Endpoint(p *flow.Port, ep netip.AddrPort) (string, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Endpoint(p, ep)
}

func (l *lockedResolver) Client(ip netip.Addr) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Client(ip)
}

// streamReader reads one response's items.
type streamReader struct {
	t      *testing.T
	resp   *http.Response
	sc     *bufio.Scanner
	cancel context.CancelFunc
}

// get requests url+query; the request ends with the test (or after a minute, so a test that
// waits for an item never sent fails instead of hanging).
func get(t *testing.T, url, query string, header ...string) *streamReader {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"?"+query, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatalf("GET ?%s: %v", query, err)
	}
	t.Cleanup(func() {
		cancel()
		resp.Body.Close()
	})
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	return &streamReader{t: t, resp: resp, sc: sc, cancel: cancel}
}

// item reads the next NDJSON item; ok is false at the end of the body.
func (s *streamReader) item() (it Item, ok bool) {
	s.t.Helper()
	if !s.sc.Scan() {
		if err := s.sc.Err(); err != nil {
			s.t.Fatalf("reading the stream: %v", err)
		}
		return Item{}, false
	}
	if err := json.Unmarshal(s.sc.Bytes(), &it); err != nil {
		s.t.Fatalf("item %q: %v", s.sc.Text(), err)
	}
	return it, true
}

func (s *streamReader) mustItem() Item {
	s.t.Helper()
	it, ok := s.item()
	if !ok {
		s.t.Fatal("the stream ended")
	}
	return it
}

// all reads the items to the end of the body and lists them compactly: f<id>, lost:<reason>:<n>.
func (s *streamReader) all() []string {
	s.t.Helper()
	var out []string
	for {
		it, ok := s.item()
		if !ok {
			return out
		}
		out = append(out, it.short())
	}
}

func (it Item) short() string {
	switch {
	case it.Flow != nil:
		return fmt.Sprintf("f%d", it.Flow.ID)
	case it.Lost != nil:
		return fmt.Sprintf("lost:%s:%d", it.Lost.Reason, it.Lost.Count)
	case it.Payload != nil:
		return fmt.Sprintf("p%d:%s:%q:%v", it.Payload.ID, it.Payload.Direction, it.Payload.Data, it.Payload.Truncated)
	}
	return "empty"
}

func recordWeb(h *Hub, from, to uint64) {
	rec := h.ForPort(webPort)
	for id := from; id <= to; id++ {
		rec.Record(webEvent(id))
	}
}

func TestStreamRing(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 8, Clock: func() time.Time { return t0.Add(10 * time.Second) }})
	url := serveHub(t, h)
	recordWeb(h, 1, 10) // the ring keeps 3..10
	dns := h.ForPort(dnsPort)
	e := filterEvents()["dns"]
	e.ID, e.Time = 11, t0.Add(11*time.Second)
	dns.Record(e)
	for _, tc := range []struct {
		query string
		want  string
	}{
		{"", "f4 f5 f6 f7 f8 f9 f10 f11"},
		{"last=3", "f9 f10 f11"},
		{"last=0", ""},
		{"last=100", "f4 f5 f6 f7 f8 f9 f10 f11"},
		{"last=2&service=web", "f9 f10"},
		{"since=" + t0.Add(9*time.Second).Format(time.RFC3339), "f9 f10 f11"},
		{"since=2s", "f8 f9 f10 f11"}, // the clock says t0+10s
		{"since=2s&last=2", "f10 f11"},
		{"not-service=web", "f11"},
		{"follow=0&verdict=unreachable", "f11"},
	} {
		t.Run(tc.query, func(t *testing.T) {
			s := get(t, url, tc.query)
			if ct := s.resp.Header.Get("Content-Type"); ct != ContentTypeNDJSON {
				t.Errorf("Content-Type %q, want %q", ct, ContentTypeNDJSON)
			}
			if diff := cmp.Diff(tc.want, strings.Join(s.all(), " ")); diff != "" {
				t.Errorf("items (-want +got):\n%s", diff)
			}
		})
	}
}

// A flow item carries the event as NewFlow converts it, pods named by the Resolver.
func TestStreamFlowFields(t *testing.T) {
	h := NewHub(HubConfig{})
	url := serveHub(t, h)
	recordWeb(h, 1, 1)
	got := get(t, url, "").mustItem().Flow
	want := NewFlow(webEvent(1), &fakeResolver{})
	want.Node, want.Namespace, want.Service, want.Port, want.Protocol, want.Path = "node-a", "default", "web", "http", "TCP", "socket"
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("flow (-want +got):\n%s", diff)
	}
	if got.EndpointPod != "default/web-abc" || got.ClientPod != "default/client-1" {
		t.Errorf("pods not named: %+v", got)
	}
}

// follow=1 sends events recorded after the request, in the order recorded, from one writer or
// several.
func TestStreamFollow(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 1 << 14})
	url := serveHub(t, h)
	recordWeb(h, 1, 3) // before the request: not sent
	s := get(t, url, "follow=1")
	// The response's headers are flushed after the observer is subscribed and has chosen its
	// start, so what is recorded now is sent.
	recordWeb(h, 4, 6)
	for want := uint64(4); want <= 6; want++ {
		if it := s.mustItem(); it.Flow == nil || it.Flow.ID != want {
			t.Fatalf("got %s, want f%d", it.short(), want)
		}
	}

	const writers, each = 4, 2500
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			base := uint64(1000000 * (w + 1))
			recordWeb(h, base+1, base+each)
		})
	}
	next := map[uint64]uint64{} // writer's base: the next id expected
	for range writers * each {
		it := s.mustItem()
		if it.Flow == nil {
			t.Fatalf("got %s, want a flow", it.short())
		}
		base := it.Flow.ID / 1000000 * 1000000
		if want := max(next[base], base+1); it.Flow.ID != want {
			t.Fatalf("got f%d, want f%d (each writer's events in its order)", it.Flow.ID, want)
		}
		next[base] = it.Flow.ID + 1
	}
	wg.Wait()
}

// Over HTTP: allow keys AND'ed, values OR'ed, any deny drops.
func TestStreamFilters(t *testing.T) {
	h := NewHub(HubConfig{})
	url := serveHub(t, h)
	s := get(t, url, "follow=1&namespace=default&namespace=kube-system&not-protocol=udp&not-path=kernel")
	evs := filterEvents()
	for _, name := range []string{"dns", "api", "web"} {
		h.ForPort(evs[name].Port).Record(evs[name])
	}
	recordWeb(h, 7, 7) // after the web event: the last item proves nothing came between
	if got := []string{s.mustItem().short(), s.mustItem().short()}; !cmp.Equal(got, []string{"f1", "f7"}) {
		t.Errorf("got %v, want [f1 f7]", got)
	}
}

// An observer that reads nothing does not slow the writers: a million Records complete while
// it is stalled, and when it reads again it is told how many events it lost, exactly.
func TestStreamSlowObserver(t *testing.T) {
	const total = 1000000
	h := NewHub(HubConfig{RingSize: 1024})
	url := serveHub(t, h)
	s := get(t, url, "follow=1") // and read nothing until the writers are done

	start := time.Now()
	recordWeb(h, 1, total)
	took := time.Since(start)
	t.Logf("%d Records with a stalled observer: %v (%v each)", total, took, took/total)

	var flows, lost, lostItems uint64
	var last uint64
	for last < total {
		it := s.mustItem()
		switch {
		case it.Lost != nil:
			if it.Lost.Reason != LostSlow {
				t.Fatalf("lost %+v, want reason %s", it.Lost, LostSlow)
			}
			lost += it.Lost.Count
			lostItems++
		case it.Flow != nil:
			// Every gap is told: the events lost since the previous flow are the ids skipped.
			if skipped := it.Flow.ID - last - 1; skipped != lost {
				t.Fatalf("f%d after f%d: %d lost items said %d", it.Flow.ID, last, skipped, lost)
			}
			flows += 1 + lost
			lost = 0
			last = it.Flow.ID
		}
	}
	if lostItems == 0 || flows != total {
		t.Errorf("%d lost items, %d events accounted; want some lost, %d", lostItems, flows, total)
	}
	if got := h.Stats().Lost[LostSlow]; got == 0 || got >= total {
		t.Errorf("Stats().Lost[%s] = %d", LostSlow, got)
	}
}

// rate=N passes N events a second; the rest are counted as lost to the rate cap. The server's
// MaxRate lowers a request's rate.
func TestStreamRateCap(t *testing.T) {
	for _, tc := range []struct {
		name    string
		maxRate int
		query   string
		pass    int
	}{
		{"request", 0, "follow=1&rate=5", 5},
		{"server caps the request", 3, "follow=1&rate=100", 3},
		{"server cap without a request rate", 4, "follow=1", 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const total = 20
			h := NewHub(HubConfig{MaxRate: tc.maxRate, Clock: fixedClock}) // no time passes: no tokens refill
			s := get(t, serveHub(t, h), tc.query)
			recordWeb(h, 1, total)
			var got []string
			var lost uint64
			for len(got)+int(lost) < total {
				it := s.mustItem()
				if it.Lost != nil {
					if it.Lost.Reason != LostRate {
						t.Fatalf("lost %+v, want reason %s", it.Lost, LostRate)
					}
					lost += it.Lost.Count
					continue
				}
				got = append(got, it.short())
			}
			var want []string
			for id := 1; id <= tc.pass; id++ {
				want = append(want, fmt.Sprintf("f%d", id))
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("flows (-want +got):\n%s", diff)
			}
			if n := h.Stats().Lost[LostRate]; n != uint64(total-tc.pass) {
				t.Errorf("Stats().Lost[%s] = %d, want %d", LostRate, n, total-tc.pass)
			}
		})
	}
}

// MaxObservers streams at once; one more gets 429 until one ends.
func TestStreamTooManyObservers(t *testing.T) {
	h := NewHub(HubConfig{MaxObservers: 2})
	url := serveHub(t, h)
	a := get(t, url, "follow=1")
	get(t, url, "follow=1")
	c := get(t, url, "follow=1")
	if c.resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("third observer: %s, want 429", c.resp.Status)
	}
	if body, _ := io.ReadAll(c.resp.Body); !strings.Contains(string(body), "too many observers (the limit is 2)") {
		t.Errorf("429 body %q", body)
	}
	a.cancel() // its request's context ends: the observer goes
	testenv.WaitFor(t, "the first observer to end", func() bool { return h.Stats().Observers == 1 })
	if d := get(t, url, "follow=1"); d.resp.StatusCode != http.StatusOK {
		t.Fatalf("after one ended: %s, want 200", d.resp.Status)
	}
}

func TestStreamSSE(t *testing.T) {
	h := NewHub(HubConfig{})
	url := serveHub(t, h)
	recordWeb(h, 1, 2)
	var want strings.Builder
	for id := uint64(1); id <= 2; id++ {
		e := *webEvent(id)
		e.Port = webPort
		b, err := json.Marshal(Item{Flow: NewFlow(&e, &fakeResolver{})})
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&want, "data: %s\n\n", b)
	}
	for _, tc := range []struct {
		name   string
		query  string
		header []string
	}{
		{"Accept", "", []string{"Accept", "text/html, text/event-stream;q=0.9"}},
		{"format=sse", "format=sse", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := get(t, url, tc.query, tc.header...)
			if ct := s.resp.Header.Get("Content-Type"); ct != ContentTypeSSE {
				t.Errorf("Content-Type %q, want %q", ct, ContentTypeSSE)
			}
			body, err := io.ReadAll(s.resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(want.String(), string(body)); diff != "" {
				t.Errorf("body (-want +got):\n%s", diff)
			}
		})
	}
}

func TestStreamBadRequest(t *testing.T) {
	h := NewHub(HubConfig{})
	url := serveHub(t, h)
	for _, tc := range []struct {
		query string
		want  string
	}{
		{"last=-1", `parameter last="-1"`},
		{"last=2&last=3", `parameter last: given 2 times`},
		{"since=yesterday", `parameter since="yesterday": want an RFC 3339 time`},
		{"rate=0", `parameter rate="0"`},
		{"follow=maybe", `parameter follow="maybe"`},
		{"format=xml", `parameter format="xml": want ndjson or sse`},
		{"capture_bytes=-5", `parameter capture_bytes="-5"`},
		{"verdict=nope", `parameter verdict: unknown verdict "nope"`},
		{"colour=red", `unknown parameter "colour"`},
	} {
		t.Run(tc.query, func(t *testing.T) {
			s := get(t, url, tc.query)
			body, _ := io.ReadAll(s.resp.Body)
			if s.resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), tc.want) {
				t.Errorf("%s %q, want 400 with %q", s.resp.Status, body, tc.want)
			}
		})
	}
	if got := h.Stats().Observers; got != 0 {
		t.Errorf("refused requests left %d observers", got)
	}
}

func TestStreamCaptureDisabled(t *testing.T) {
	h := NewHub(HubConfig{})
	s := get(t, serveHub(t, h), "capture=1")
	body, _ := io.ReadAll(s.resp.Body)
	if s.resp.StatusCode != http.StatusForbidden || !strings.Contains(string(body), "payload capture is disabled") {
		t.Errorf("%s %q, want 403 saying capture is disabled", s.resp.Status, body)
	}
	if tap := h.ForPort(webPort).(flow.Capturer).Capture(webEvent(1)); tap != nil {
		t.Error("Capture returned a tap with capture disabled")
	}
}

// A fake data path captures the flows a capturing observer's filter passes; each flow is cut at
// the per-flow cap (the piece that reaches it marked truncated), each observer at its total.
func TestStreamCapture(t *testing.T) {
	h := NewHub(HubConfig{Capture: true, CaptureFlowBytes: 10, CaptureTotalBytes: 14})
	url := serveHub(t, h)
	s := get(t, url, "follow=1&capture=1&capture_bytes=100&service=web") // lowered to 10
	nocap := get(t, url, "follow=1")                                     // no capture: no payload
	if st := h.Stats(); st.Captures != 1 || st.Observers != 2 {
		t.Fatalf("Stats() = %+v, want 1 capture of 2 observers", st)
	}
	web, dns := h.ForPort(webPort).(flow.Capturer), h.ForPort(dnsPort).(flow.Capturer)
	if tap := dns.Capture(filterEvents()["dns"]); tap != nil {
		t.Fatal("a flow the filter refuses was captured")
	}
	tap := web.Capture(webEvent(1))
	if tap == nil {
		t.Fatal("a flow the filter passes was not captured")
	}
	if n := h.Stats().Taps; n != 1 {
		t.Errorf("Stats().Taps = %d, want 1", n)
	}
	buf := []byte("hello")
	tap.Payload(flow.ToEndpoint, t0, buf)
	copy(buf, "XXXXX")                                // the data path reuses its buffer
	tap.Payload(flow.ToClient, t0, []byte("world!!")) // 5 of 7 bytes: the flow's 10
	tap.Payload(flow.ToEndpoint, t0, []byte("more"))  // past the cap: nothing
	tap.Close()
	tap.Close() // once is counted
	if n := h.Stats().Taps; n != 0 {
		t.Errorf("Stats().Taps after Close = %d, want 0", n)
	}
	// The second flow has 4 bytes of the observer's 14 left.
	tap2 := web.Capture(webEvent(2))
	tap2.Payload(flow.ToEndpoint, t0, []byte("abcdef"))
	tap2.Close()
	if tap3 := web.Capture(webEvent(3)); tap3 != nil {
		t.Error("a flow was captured after the observer's total was spent")
	}
	recordWeb(h, 9, 9) // a flow item after the payload

	// Payload pieces keep their order; flow items may come between them.
	var got []string
	for len(got) < 4 {
		it := s.mustItem()
		if it.Lost != nil {
			t.Fatalf("got %s", it.short())
		}
		got = append(got, it.short())
	}
	slices.SortStableFunc(got, func(a, b string) int { return strings.Compare(a[:1], b[:1]) }) // flows first
	want := []string{"f9", `p1:to-endpoint:"hello":false`, `p1:to-client:"world":true`, `p2:to-endpoint:"abcd":true`}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("items (-want +got):\n%s", diff)
	}
	if it := nocap.mustItem(); it.short() != "f9" {
		t.Errorf("the observer without capture got %s, want f9", it.short())
	}
}

// A payload queue that overflows drops pieces and says how many.
func TestStreamCaptureOverflow(t *testing.T) {
	h := NewHub(HubConfig{Capture: true})
	s := get(t, serveHub(t, h), "follow=1&capture=1")
	tap := h.ForPort(webPort).(flow.Capturer).Capture(webEvent(1))
	if tap == nil {
		t.Fatal("not captured")
	}
	// Fill the queue faster than any reader: the observer may drain some; the rest is counted.
	const pieces = 20 * payloadQueue
	for range pieces {
		tap.Payload(flow.ToEndpoint, t0, []byte("x"))
	}
	tap.Close()
	var payloads, lost uint64
	for payloads+lost < pieces {
		it := s.mustItem()
		switch {
		case it.Lost != nil:
			if it.Lost.Reason != LostCapture {
				t.Fatalf("lost %+v", it.Lost)
			}
			lost += it.Lost.Count
		case it.Payload != nil:
			payloads++
		default:
			t.Fatalf("got %s", it.short())
		}
	}
	if lost == 0 || payloads+lost != pieces {
		t.Errorf("%d payloads + %d lost, want some lost and %d in all", payloads, lost, pieces)
	}
	if n := h.Stats().Lost[LostCapture]; n != lost {
		t.Errorf("Stats().Lost[%s] = %d, want %d", LostCapture, n, lost)
	}
}

// Drops are said even when the drain stops at its bound with the queue just emptied (the
// observer may then sleep with nothing to wake it).
func TestDrainPayloadsSaysDropsAtTheBound(t *testing.T) {
	h := NewHub(HubConfig{Capture: true})
	o := newObserver(h, nil, nil, time.Time{})
	o.capture = true
	o.payloads = make(chan *Payload, payloadQueue)
	for range payloadQueue {
		o.payloads <- &Payload{ID: 1}
	}
	o.payloadsLost.Store(5)
	w := httptest.NewRecorder()
	st := &stream{w: w, rc: http.NewResponseController(w), hub: h}
	o.drainPayloads(st)
	if n := st.pending[lostCapture]; n != 5 {
		t.Errorf("after a full drain, %d drops pending to be said, want 5", n)
	}
}

// A client that stops reading is given up after the write stall, freeing its observer slot;
// Record never waits for it.
func TestStreamStalledClientEnded(t *testing.T) {
	h := NewHub(HubConfig{RingSize: 1024})
	h.writeStall = 100 * time.Millisecond
	url := serveHub(t, h)
	get(t, url, "follow=1") // never read
	// Write until the socket buffers fill and the observer's batch stalls past the deadline.
	deadline := time.Now().Add(20 * time.Second) // well before the request's own timeout
	for id := uint64(1); h.Stats().Observers != 0; id += 1000 {
		if time.Now().After(deadline) {
			t.Fatal("the stalled observer was not ended")
		}
		recordWeb(h, id, id+999)
	}
}

// A TCP flow's two directions call Payload from their own goroutines: the flow's cap holds
// across both, and one piece (the one that reached it) is marked truncated.
func TestStreamCaptureBothDirections(t *testing.T) {
	const flowCap = 1000
	h := NewHub(HubConfig{Capture: true, CaptureFlowBytes: flowCap})
	s := get(t, serveHub(t, h), "follow=1&capture=1")
	tap := h.ForPort(webPort).(flow.Capturer).Capture(webEvent(1))
	if tap == nil {
		t.Fatal("not captured")
	}
	var wg sync.WaitGroup
	for _, dir := range []flow.Direction{flow.ToEndpoint, flow.ToClient} {
		wg.Go(func() {
			b := []byte("0123456789")
			for range 100 { // 1000 bytes each way: twice the cap
				tap.Payload(dir, t0, b)
			}
		})
	}
	wg.Wait()
	tap.Close()
	var bytes, truncated int
	for bytes < flowCap || truncated == 0 {
		it := s.mustItem()
		if it.Payload == nil {
			t.Fatalf("got %s", it.short())
		}
		bytes += len(it.Payload.Data)
		if it.Payload.Truncated {
			truncated++
		}
	}
	if bytes != flowCap || truncated != 1 {
		t.Errorf("%d bytes, %d truncated pieces; want %d, 1", bytes, truncated, flowCap)
	}
}
