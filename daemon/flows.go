package daemon

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

// flowsPath is where the flow stream is served, on the metrics address (and on
// --flows-bind-address, behind token authentication).
const flowsPath = "/debug/flows"

// newFlowHub is the live flow stream's ring, or nil when --flow-ring-size is 0.
func newFlowHub(o *Options, node string) *observe.Hub {
	if o.flows.ringSize == 0 {
		return nil
	}
	return observe.NewHub(observe.HubConfig{
		RingSize: o.flows.ringSize, MaxObservers: o.flows.maxObservers, MaxRate: o.flows.maxRate,
		Capture: o.flows.capture, CaptureFlowBytes: o.flows.captureBytes, Node: node,
	})
}

// flowSink is hub as the proxier's FlowSink: nil (no interface value) without a hub.
func flowSink(hub *observe.Hub) proxier.FlowSink {
	if hub == nil {
		return nil
	}
	return hub
}

// flowCollector exports the hub's counters: how many events were recorded, how many observers
// lost (by reason), and how many watch now.
func flowCollector(hub *observe.Hub) prometheus.Collector {
	events := prometheus.NewDesc("kube_portal_proxy_flow_events_total",
		"Flow events recorded in the live flow stream's ring (each phase of each TCP connection and UDP session, and kernel-path flows from conntrack).", nil, nil)
	lost := prometheus.NewDesc("kube_portal_proxy_flow_events_lost_total",
		"Flow events (and captured payload pieces) observers of /debug/flows did not get, by reason: slow-observer (the ring overtook it), rate-cap (over its rate), capture (its payload queue or cap was full).", []string{"reason"}, nil)
	observers := prometheus.NewDesc("kube_portal_proxy_flow_observers",
		"Observers of /debug/flows now, and how many of them capture payload.", []string{"kind"}, nil)
	return collectorFunc{descs: []*prometheus.Desc{events, lost, observers}, collect: func(ch chan<- prometheus.Metric) {
		st := hub.Stats()
		ch <- prometheus.MustNewConstMetric(events, prometheus.CounterValue, float64(st.Events))
		for reason, n := range st.Lost {
			ch <- prometheus.MustNewConstMetric(lost, prometheus.CounterValue, float64(n), reason)
		}
		ch <- prometheus.MustNewConstMetric(observers, prometheus.GaugeValue, float64(st.Observers), "all")
		ch <- prometheus.MustNewConstMetric(observers, prometheus.GaugeValue, float64(st.Captures), "capture")
	}}
}

// flowsMux serves the flow stream alone (--flows-bind-address), each request through authz.
func flowsMux(stream http.Handler, authz func(http.Handler) http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle(flowsPath, authz(stream))
	return mux
}
