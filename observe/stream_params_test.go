package observe

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestParseRequest checks the parameters of /debug/flows that are not filters: their values,
// defaults and caps, and the error that names a bad one.
func TestParseRequest(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	h := NewHub(HubConfig{RingSize: 8, MaxRate: 100, CaptureFlowBytes: 1000, Clock: func() time.Time { return now }})
	for _, tc := range []struct {
		query, accept string
		want          request
	}{
		{"", "", request{last: -1, rate: 100, captureFlow: 1000}},
		{"follow=1&last=0&rate=7&capture=true&capture_bytes=10", "", request{follow: true, rate: 7, capture: true, captureFlow: 10}},
		{"last=5&rate=500&capture_bytes=5000&capture=0", "", request{last: 5, rate: 100, captureFlow: 1000}},
		{"since=5m", "", request{last: -1, since: now.Add(-5 * time.Minute), rate: 100, captureFlow: 1000}},
		{"since=2026-01-01T00:00:00Z", "", request{last: -1, since: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), rate: 100, captureFlow: 1000}},
		{"", "text/html, text/event-stream;q=0.9", request{last: -1, rate: 100, captureFlow: 1000, sse: true}},
		{"format=ndjson", "text/event-stream", request{last: -1, rate: 100, captureFlow: 1000}},
		{"format=sse", "", request{last: -1, rate: 100, captureFlow: 1000, sse: true}},
	} {
		r := httptest.NewRequest("GET", "/debug/flows?"+tc.query, nil)
		if tc.accept != "" {
			r.Header.Set("Accept", tc.accept)
		}
		got, err := h.parseRequest(r)
		if err != nil {
			t.Errorf("%s: %v", tc.query, err)
			continue
		}
		if got.filter == nil {
			t.Errorf("%s: no filter", tc.query)
		}
		got.filter = nil
		if *got != tc.want {
			t.Errorf("%s (Accept %q): %+v, want %+v", tc.query, tc.accept, *got, tc.want)
		}
	}
	for query, want := range map[string]string{
		"follow=1&follow=0": "parameter follow: given 2 times, want once",
		"follow=yes":        `parameter follow="yes": want 1 or 0`,
		"last=-1":           `parameter last="-1": want a count of events (0 or more)`,
		"since=-5m":         `parameter since="-5m": want an RFC 3339 time`,
		"since=yesterday":   `parameter since="yesterday": want an RFC 3339 time`,
		"rate=0":            `parameter rate="0": want events per second (1 or more)`,
		"capture=maybe":     `parameter capture="maybe": want 1 or 0`,
		"capture_bytes=x":   `parameter capture_bytes="x": want bytes per flow (1 or more)`,
		"format=xml":        `parameter format="xml": want ndjson or sse`,
		"protocol=sctp":     `parameter protocol: "sctp": want tcp or udp`,
		"last=x&format=xml": `parameter last="x"`,
	} {
		_, err := h.parseRequest(httptest.NewRequest("GET", "/debug/flows?"+query, nil))
		if err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("%s: error %v, want one starting %q", query, err, want)
		}
	}
}
