// Package healthcheck answers the health questions kube-proxy answers, with kube-proxy's semantics
// and bodies: the proxy's own /healthz (readiness, which includes whether this node is being
// removed) and /livez (liveness, which does not), and one health check node port per Service with
// externalTrafficPolicy: Local, which tells a cloud load balancer whether this node has a ready
// endpoint of that Service.
package healthcheck

import (
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// ToBeDeletedTaint is the taint the Cluster Autoscaler puts on a node it is about to delete;
// kube-proxy reports such a node unhealthy on /healthz so load balancers drain it first.
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// ProxyHealth tells whether the proxier keeps up and whether this node should still receive load
// balancer traffic. The proxier is unhealthy when a change has waited longer than the timeout
// (2 × --iptables-sync-period, as in kube-proxy) without a successful sync. /healthz also fails
// while the node is being deleted or is tainted for deletion (KEP-3836); /livez does not, so a
// node being drained never gets its proxy restarted.
type ProxyHealth struct {
	clock   clock.PassiveClock
	timeout time.Duration

	mu           sync.Mutex
	pending      bool      // a change waits for a sync
	oldestQueued time.Time // when the oldest unserved change was queued
	lastUpdated  time.Time
	// nodeIneligible is the negation of kube-proxy's nodeEligible, so the zero value means
	// eligible: like kube-proxy before its first Node event, a proxy that has not heard about its
	// node yet does not take itself out of load balancers.
	nodeIneligible bool
}

// NewProxyHealth returns a tracker with the given staleness timeout. It starts nothing.
func NewProxyHealth(c clock.PassiveClock, timeout time.Duration) *ProxyHealth {
	return &ProxyHealth{clock: c, timeout: timeout}
}

// QueuedUpdate records that a change is waiting for a sync. Only the oldest unserved change
// counts, so a steady stream of changes cannot hide a stuck sync loop.
func (h *ProxyHealth) QueuedUpdate() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.pending {
		h.pending = true
		h.oldestQueued = h.clock.Now()
	}
}

// Updated records a successful sync: every change queued so far is served.
func (h *ProxyHealth) Updated() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.pending = false
	h.lastUpdated = h.clock.Now()
}

// SyncNode records what this node's object says: deleting when its deletionTimestamp is set, and
// the keys of its spec.taints. Taking plain values keeps this package free of k8s.io/api; the
// caller that watches the Node converts it.
func (h *ProxyHealth) SyncNode(deleting bool, taintKeys ...string) {
	ineligible := deleting
	for _, k := range taintKeys {
		if k == ToBeDeletedTaint {
			ineligible = true
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.nodeIneligible = ineligible
}

// Status is a snapshot of the proxy's health.
type Status struct {
	// Healthy is the proxier's own health: no change has waited longer than the timeout.
	Healthy bool
	// NodeEligible is false while the node is being deleted or is tainted for deletion.
	NodeEligible bool
	LastUpdated  time.Time
	CurrentTime  time.Time
}

// Status reports health with the times it is based on.
func (h *ProxyHealth) Status() Status {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.clock.Now()
	return Status{
		Healthy:      !h.pending || now.Sub(h.oldestQueued) < h.timeout,
		NodeEligible: !h.nodeIneligible,
		LastUpdated:  h.lastUpdated,
		CurrentTime:  now,
	}
}

// IsHealthy reports the proxier's health alone, ignoring the node: what kube-proxy puts in the
// serviceProxyHealthy field of every service health check.
func (h *ProxyHealth) IsHealthy() bool { return h.Status().Healthy }

// Healthz returns the /healthz handler: 200 when the proxier is healthy and the node eligible, 503
// otherwise. It is the readiness probe and the target of load balancers for externalTrafficPolicy:
// Cluster services.
func (h *ProxyHealth) Healthz() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		st := h.Status()
		writeProxyHealth(w, st, st.Healthy && st.NodeEligible, &st.NodeEligible)
	})
}

// Livez returns the /livez handler: 200 when the proxier is healthy, whatever the node's state.
func (h *ProxyHealth) Livez() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		st := h.Status()
		writeProxyHealth(w, st, st.Healthy, nil)
	})
}

// proxyHealthBody is kube-proxy's body, field for field and in its order, except the per-family
// "status" map: one proxier here serves both families, so it would repeat the top level.
type proxyHealthBody struct {
	LastUpdated time.Time `json:"lastUpdated"`
	CurrentTime time.Time `json:"currentTime"`
	// NodeEligible is only in /healthz answers.
	NodeEligible *bool `json:"nodeEligible,omitempty"`
	// Healthy is the proxier's health, not the status code: kube-proxy answers 503 with
	// "healthy": true when only the node is ineligible.
	Healthy bool `json:"healthy"`
}

func writeProxyHealth(w http.ResponseWriter, st Status, ok bool, nodeEligible *bool) {
	body := proxyHealthBody{LastUpdated: st.LastUpdated.UTC(), CurrentTime: st.CurrentTime.UTC(),
		NodeEligible: nodeEligible, Healthy: st.Healthy}
	if ok {
		// kube-proxy's compatibility rule: older releases bumped lastUpdated on every sync loop
		// run, so a healthy answer reports "now".
		body.LastUpdated = body.CurrentTime
	}
	out, err := json.Marshal(body)
	if err != nil { // cannot happen: times within year 0-9999 and a bool
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if ok {
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_, _ = w.Write(out)
}
