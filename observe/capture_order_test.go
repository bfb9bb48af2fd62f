package observe

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// TestCapturePayloadBeforeItsFlowsEnd: an observer that lags (a busy machine) finds a whole flow
// in the ring at once, its payload queued beside it. The flow's payload must reach it before the
// flow's End, as it happened: a capture reader closes the flow at End and drops what comes after
// (observe/pcap). (Before, a batch sent every event first and the payload after it.)
func TestCapturePayloadBeforeItsFlowsEnd(t *testing.T) {
	h := NewHub(HubConfig{Capture: true})
	o := newObserver(h, nil, nil, time.Time{})
	o.capture, o.captureFlow, o.payloads = true, DefaultCaptureFlowBytes, make(chan *Payload, payloadQueue)
	o.captureLeft.Store(DefaultCaptureTotalBytes)
	h.subscribe(o)
	defer h.unsubscribe(o)

	port := &flow.Port{Namespace: "default", Service: "web", Port: "http", Protocol: flow.TCP, Path: flow.PathSocket}
	rec := h.ForPort(port)
	e := &flow.Event{ID: 7, Time: time.Now(), Port: port,
		Info: flow.Info{Client: netip.MustParseAddrPort("10.0.0.1:40000"), Endpoint: netip.MustParseAddrPort("10.1.0.5:8080")}}
	for _, ph := range []flow.Phase{flow.PhaseStart, flow.PhaseDial} {
		e.Phase = ph
		rec.Record(e)
	}
	tap := rec.(flow.Capturer).Capture(e)
	if tap == nil {
		t.Fatal("no tap for the capturing observer")
	}
	tap.Payload(flow.ToEndpoint, time.Now(), []byte("GET / HTTP/1.1\r\n\r\n"))
	e.Phase = flow.PhaseFirstByte
	rec.Record(e)
	tap.Payload(flow.ToClient, time.Now(), []byte("HTTP/1.1 200 OK\r\n\r\n"))
	e.Phase = flow.PhaseEnd
	rec.Record(e)
	tap.Close()

	// The observer wakes now: the whole flow is there.
	w := httptest.NewRecorder()
	st := &stream{w: w, rc: http.NewResponseController(w), hub: h}
	o.run(t.Context(), st, h.oldest(h.head.Load()), h.head.Load())
	var got []string
	for line := range strings.Lines(w.Body.String()) {
		var it Item
		if err := json.Unmarshal([]byte(line), &it); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		switch {
		case it.Flow != nil:
			got = append(got, it.Flow.Phase)
		case it.Payload != nil:
			got = append(got, "payload "+it.Payload.Direction)
		}
	}
	end := -1
	for i, s := range got {
		if s == "end" {
			end = i
		}
	}
	payloads := 0
	for i, s := range got {
		if strings.HasPrefix(s, "payload ") {
			payloads++
			if i > end {
				t.Errorf("items %q: %s after the flow's end", got, s)
			}
		}
	}
	if payloads != 2 || end < 0 {
		t.Errorf("items %q: want both payload pieces and the end", got)
	}
}
