package healthcheck

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan: one httptest server on 127.0.0.1 (an ephemeral port) serving /healthz and /livez
// of a tracker driven by a fake clock.

const timeout = time.Minute

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 123456789, time.UTC)

type answer struct {
	code int
	body string
}

func TestProxyHealth(t *testing.T) {
	const (
		zero = "0001-01-01T00:00:00Z"
		t0s  = "2026-01-02T03:04:05.123456789Z"
		t1s  = "2026-01-02T03:04:06.123456789Z"
	)
	for _, tc := range []struct {
		name           string
		steps          func(h *ProxyHealth, c *clocktesting.FakePassiveClock)
		healthz, livez answer
	}{{
		name:    "fresh_is_healthy",
		steps:   func(*ProxyHealth, *clocktesting.FakePassiveClock) {},
		healthz: answer{200, `{"lastUpdated":"` + t0s + `","currentTime":"` + t0s + `","nodeEligible":true,"healthy":true}`},
		livez:   answer{200, `{"lastUpdated":"` + t0s + `","currentTime":"` + t0s + `","healthy":true}`},
	}, {
		name: "change_waiting_less_than_the_timeout_is_healthy",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.QueuedUpdate()
			c.SetTime(t0.Add(timeout - time.Nanosecond))
		},
		healthz: answer{200, `{"lastUpdated":"2026-01-02T03:05:05.123456788Z","currentTime":"2026-01-02T03:05:05.123456788Z","nodeEligible":true,"healthy":true}`},
		livez:   answer{200, `{"lastUpdated":"2026-01-02T03:05:05.123456788Z","currentTime":"2026-01-02T03:05:05.123456788Z","healthy":true}`},
	}, {
		name: "stale_change_fails_both_and_reports_the_last_sync",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.Updated()
			c.SetTime(t0.Add(time.Second))
			h.QueuedUpdate()
			c.SetTime(t0.Add(time.Second + timeout))
		},
		healthz: answer{503, `{"lastUpdated":"` + t0s + `","currentTime":"2026-01-02T03:05:06.123456789Z","nodeEligible":true,"healthy":false}`},
		livez:   answer{503, `{"lastUpdated":"` + t0s + `","currentTime":"2026-01-02T03:05:06.123456789Z","healthy":false}`},
	}, {
		name: "stale_before_the_first_sync_reports_zero_time",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.QueuedUpdate()
			c.SetTime(t0.Add(timeout))
		},
		healthz: answer{503, `{"lastUpdated":"` + zero + `","currentTime":"2026-01-02T03:05:05.123456789Z","nodeEligible":true,"healthy":false}`},
		livez:   answer{503, `{"lastUpdated":"` + zero + `","currentTime":"2026-01-02T03:05:05.123456789Z","healthy":false}`},
	}, {
		name: "served_change_is_healthy_however_long_after",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.QueuedUpdate()
			c.SetTime(t0.Add(time.Second))
			h.Updated()
			c.SetTime(t0.Add(10 * timeout))
		},
		healthz: answer{200, `{"lastUpdated":"2026-01-02T03:14:05.123456789Z","currentTime":"2026-01-02T03:14:05.123456789Z","nodeEligible":true,"healthy":true}`},
		livez:   answer{200, `{"lastUpdated":"2026-01-02T03:14:05.123456789Z","currentTime":"2026-01-02T03:14:05.123456789Z","healthy":true}`},
	}, {
		name: "oldest_unserved_change_counts",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.QueuedUpdate()
			c.SetTime(t0.Add(timeout / 2))
			h.QueuedUpdate()
			c.SetTime(t0.Add(timeout))
		},
		healthz: answer{503, `{"lastUpdated":"` + zero + `","currentTime":"2026-01-02T03:05:05.123456789Z","nodeEligible":true,"healthy":false}`},
		livez:   answer{503, `{"lastUpdated":"` + zero + `","currentTime":"2026-01-02T03:05:05.123456789Z","healthy":false}`},
	}, {
		// proxier/health.go compared times, so a change queued in the instant of a sync was lost.
		name: "change_queued_at_the_instant_of_a_sync_counts",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.Updated()
			h.QueuedUpdate()
			c.SetTime(t0.Add(timeout))
		},
		healthz: answer{503, `{"lastUpdated":"` + t0s + `","currentTime":"2026-01-02T03:05:05.123456789Z","nodeEligible":true,"healthy":false}`},
		livez:   answer{503, `{"lastUpdated":"` + t0s + `","currentTime":"2026-01-02T03:05:05.123456789Z","healthy":false}`},
	}, {
		// A 503 reports the real last sync, "now" is only for a 200 (as kube-proxy).
		name: "node_being_deleted_fails_healthz_only",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.Updated()
			c.SetTime(t0.Add(time.Second))
			h.SyncNode(true)
		},
		healthz: answer{503, `{"lastUpdated":"` + t0s + `","currentTime":"` + t1s + `","nodeEligible":false,"healthy":true}`},
		livez:   answer{200, `{"lastUpdated":"` + t1s + `","currentTime":"` + t1s + `","healthy":true}`},
	}, {
		name: "node_tainted_for_deletion_fails_healthz_only",
		steps: func(h *ProxyHealth, _ *clocktesting.FakePassiveClock) {
			h.SyncNode(false, "node.kubernetes.io/unschedulable", ToBeDeletedTaint)
		},
		healthz: answer{503, `{"lastUpdated":"` + zero + `","currentTime":"` + t0s + `","nodeEligible":false,"healthy":true}`},
		livez:   answer{200, `{"lastUpdated":"` + t0s + `","currentTime":"` + t0s + `","healthy":true}`},
	}, {
		name: "other_taints_keep_the_node_eligible",
		steps: func(h *ProxyHealth, _ *clocktesting.FakePassiveClock) {
			h.SyncNode(true)
			h.SyncNode(false, "node.kubernetes.io/unschedulable", "DeletionCandidateOfClusterAutoscaler")
		},
		healthz: answer{200, `{"lastUpdated":"` + t0s + `","currentTime":"` + t0s + `","nodeEligible":true,"healthy":true}`},
		livez:   answer{200, `{"lastUpdated":"` + t0s + `","currentTime":"` + t0s + `","healthy":true}`},
	}, {
		name: "stale_on_a_deleted_node_fails_both",
		steps: func(h *ProxyHealth, c *clocktesting.FakePassiveClock) {
			h.SyncNode(true)
			h.QueuedUpdate()
			c.SetTime(t0.Add(timeout))
		},
		healthz: answer{503, `{"lastUpdated":"` + zero + `","currentTime":"2026-01-02T03:05:05.123456789Z","nodeEligible":false,"healthy":false}`},
		livez:   answer{503, `{"lastUpdated":"` + zero + `","currentTime":"2026-01-02T03:05:05.123456789Z","healthy":false}`},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			c := clocktesting.NewFakePassiveClock(t0)
			h := NewProxyHealth(c, timeout)
			mux := http.NewServeMux()
			mux.Handle("/healthz", h.Healthz())
			mux.Handle("/livez", h.Livez())
			srv := httptest.NewServer(mux)
			defer srv.Close()

			tc.steps(h, c)
			for _, p := range []struct {
				path string
				want answer
			}{{"/healthz", tc.healthz}, {"/livez", tc.livez}} {
				got := fetch(t, srv.URL+p.path)
				if got != p.want {
					t.Errorf("GET %s:\n got %d %s\nwant %d %s", p.path, got.code, got.body, p.want.code, p.want.body)
				}
			}
		})
	}
}

func TestProxyHealthHeaders(t *testing.T) {
	h := NewProxyHealth(clocktesting.NewFakePassiveClock(t0), timeout)
	for name, handler := range map[string]http.Handler{"healthz": h.Healthz(), "livez": h.Livez()} {
		srv := httptest.NewServer(handler)
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		srv.Close()
		for k, want := range map[string]string{"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"} {
			if got := resp.Header.Get(k); got != want {
				t.Errorf("%s: header %s = %q, want %q", name, k, got, want)
			}
		}
	}
}

func TestIsHealthyIgnoresTheNode(t *testing.T) {
	c := clocktesting.NewFakePassiveClock(t0)
	h := NewProxyHealth(c, timeout)
	h.SyncNode(true, ToBeDeletedTaint)
	if !h.IsHealthy() {
		t.Error("IsHealthy() = false on a deleted node with a synced proxier, want true")
	}
	h.QueuedUpdate()
	c.SetTime(t0.Add(timeout))
	if h.IsHealthy() {
		t.Error("IsHealthy() = true with a change waiting for the whole timeout, want false")
	}
}

func fetch(t *testing.T, url string) answer {
	t.Helper()
	code, body := testenv.Get(t, url)
	return answer{code, body}
}
