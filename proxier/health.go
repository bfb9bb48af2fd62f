package proxier

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// Health tells whether the proxier keeps up: it is unhealthy when a change has waited longer than
// the timeout (2 × --iptables-sync-period, as in kube-proxy) without a successful sync. The legacy
// userspace mode answered 200 whatever happened.
type Health struct {
	clock   clock.PassiveClock
	timeout time.Duration

	mu          sync.Mutex
	lastQueued  time.Time
	lastUpdated time.Time
}

// NewHealth returns a tracker with the given staleness timeout.
func NewHealth(c clock.PassiveClock, timeout time.Duration) *Health {
	return &Health{clock: c, timeout: timeout}
}

// QueuedUpdate records that a change is waiting for a sync.
func (h *Health) QueuedUpdate() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.lastQueued.After(h.lastUpdated) {
		h.lastQueued = h.clock.Now() // keep the oldest unserved change
	}
}

// Updated records a successful sync.
func (h *Health) Updated() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lastUpdated = h.clock.Now()
}

// Status reports health with the times it is based on.
func (h *Health) Status() (healthy bool, lastUpdated, now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now = h.clock.Now()
	pending := h.lastQueued.After(h.lastUpdated)
	healthy = !pending || now.Sub(h.lastQueued) < h.timeout
	return healthy, h.lastUpdated, now
}

// ServeHTTP answers /healthz and /livez: 200 when healthy, 503 otherwise, with kube-proxy's body.
func (h *Health) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	healthy, last, now := h.Status()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if !healthy {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(struct {
		LastUpdated string `json:"lastUpdated"`
		CurrentTime string `json:"currentTime"`
	}{last.UTC().Format(time.RFC3339Nano), now.UTC().Format(time.RFC3339Nano)})
}
