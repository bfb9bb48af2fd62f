// Package metrics holds the proxier's Prometheus series: the sync series under kube-proxy's
// names (Metrics, updated by the proxier as it syncs) and the per-service-port traffic series
// read from the proxy sockets' counters at scrape time (NewTrafficCollector).
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the proxier's Prometheus series. Sync series keep kube-proxy's names so existing
// dashboards and alerts work unchanged; the proxier's own carry the kube_portal_proxy_ prefix.
// The proxier updates the fields itself.
type Metrics struct {
	SyncDuration          prometheus.Histogram
	LastSync              prometheus.Gauge
	Programming           *prometheus.HistogramVec
	ServiceChanges        prometheus.Counter
	EndpointChanges       prometheus.Counter
	PendingServiceChanges prometheus.Gauge
	SyncFailures          prometheus.Counter
	SyncFailing           prometheus.Gauge
	ActivePorts           prometheus.Gauge
	FailedPorts           prometheus.Gauge
	SocketFailures        prometheus.Counter
	UnsupportedPorts      prometheus.Counter
	RefusedPorts          *prometheus.GaugeVec
}

// New creates the series; Register adds them to a registry.
func New() *Metrics {
	m := &Metrics{
		SyncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Subsystem: "kubeproxy", Name: "sync_proxy_rules_duration_seconds",
			Help:    "SyncProxyRules latency in seconds",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
		}),
		LastSync: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "kubeproxy", Name: "sync_proxy_rules_last_timestamp_seconds",
			Help: "The last time proxy rules were successfully synced",
		}),
		// kube-proxy's SLI, measured as kube-proxy measures it (see ObserveProgramming): same
		// name, label and buckets.
		Programming: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Subsystem: "kubeproxy", Name: "network_programming_duration_seconds",
			Help:    "In Cluster Network Programming Latency in seconds",
			Buckets: merge(prometheus.LinearBuckets(0.25, 0.25, 2), prometheus.LinearBuckets(1, 1, 59), prometheus.LinearBuckets(60, 5, 12), prometheus.LinearBuckets(120, 30, 7)),
		}, []string{"ip_family"}),
		ServiceChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "kubeproxy", Name: "sync_proxy_rules_service_changes_total",
			Help: "Cumulative proxy rules Service changes",
		}),
		EndpointChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Subsystem: "kubeproxy", Name: "sync_proxy_rules_endpoint_changes_total",
			Help: "Cumulative proxy rules Endpoint changes",
		}),
		PendingServiceChanges: prometheus.NewGauge(prometheus.GaugeOpts{
			Subsystem: "kubeproxy", Name: "sync_proxy_rules_service_changes_pending",
			Help: "Pending proxy rules Service changes",
		}),
	}
	m.addPortalSeries()
	return m
}

// addPortalSeries adds the series of this proxy's own (the others are kube-proxy's, same names).
func (m *Metrics) addPortalSeries() {
	m.SyncFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_portal_proxy_sync_failures_total",
		Help: "Syncs whose portal programming failed (retried on the next sync).",
	})
	// The counter says failures happened; the gauge says whether they still do, so an alert
	// clears with the first good sync instead of when a rate window has passed.
	m.SyncFailing = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_portal_proxy_sync_failing",
		Help: "1 while the last sync failed (its portal programming; retried), 0 once one succeeds.",
	})
	m.ActivePorts = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_portal_proxy_proxy_ports",
		Help: "Service ports with an open proxy socket.",
	})
	m.FailedPorts = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kube_portal_proxy_proxy_ports_failed",
		Help: "Service ports whose proxy socket could not open (they have no portal).",
	})
	m.SocketFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_portal_proxy_proxy_socket_open_failures_total",
		Help: "Failed attempts to open a proxy socket.",
	})
	m.UnsupportedPorts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kube_portal_proxy_unsupported_service_ports_total",
		Help: "Service ports skipped because their protocol (SCTP) cannot be proxied in userspace.",
	})
	m.RefusedPorts = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kube_portal_proxy_refused_service_ports",
		Help: "Service ports whose traffic class (cluster: cluster IPs; external: node port, external and load-balancer IPs) has no usable endpoint and is refused by the kernel (TCP reset, ICMP port unreachable); the refused connections themselves are not counted.",
	}, []string{"traffic"})
}

// Register adds every series to r.
func (m *Metrics) Register(r prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.SyncDuration, m.LastSync, m.Programming, m.ServiceChanges,
		m.EndpointChanges, m.PendingServiceChanges, m.SyncFailures, m.SyncFailing, m.ActivePorts, m.FailedPorts,
		m.SocketFailures, m.UnsupportedPorts, m.RefusedPorts} {
		if err := r.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// ObserveProgramming records one network programming latency: from the moment an EndpointSlice's
// change was triggered (its endpoints.kubernetes.io/last-change-trigger-time annotation) to the
// change being in force here, for slices of family ("IPv4", "IPv6", as kube-proxy labels it).
func (m *Metrics) ObserveProgramming(family string, now, changed time.Time) {
	if d := now.Sub(changed); d >= 0 {
		m.Programming.WithLabelValues(family).Observe(d.Seconds())
	}
}

func merge(parts ...[]float64) []float64 {
	var out []float64
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}
