package metrics

import (
	"iter"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// PortTraffic is what the traffic series show of one open service port at a scrape.
type PortTraffic struct {
	Name     service.ServicePortName
	Protocol service.Protocol
	// Balanced: the balancer has an entry for the port, using Endpoints endpoints.
	Balanced  bool
	Endpoints int
	// Outlier: the port has outlier detection on; Ejections and Ejected are then its counts.
	Outlier   bool
	Ejections uint64
	Ejected   int
	// Observed: the port's socket keeps counters (Stats); sockets of tests may not.
	Observed bool
	Stats    flow.Stats
	// Drain: the port has a drain-timeout; Drained is then the flows its deadline closed,
	// over all of the port's sockets.
	Drain   bool
	Drained uint64
	// Holds: the port holds connections while it has no endpoint (TCP).
	Holds bool
	// Transparent: the port is in the transparent source mode; TransparentDials and
	// TransparentFallbacks then count over all of the port's sockets.
	Transparent                            bool
	TransparentDials, TransparentFallbacks uint64
}

// TrafficSource lists the open service ports at a scrape: the proxier implements it. Traffic may
// hold the source's lock while it yields (the proxier's sync waits for it), so a consumer copies
// what it yields and writes afterwards: it neither blocks nor calls back into the source in yield.
type TrafficSource interface {
	Traffic() iter.Seq[PortTraffic]
}

// family is one traffic series family: its name, help, type and extra label names (besides
// service_port, which sorts after every one of them), and the samples a port has in it. Both the
// Prometheus collector and the text writer (Handler) read this table, so the two cannot differ.
type family struct {
	name, help string
	gauge      bool
	labels     []string // at most two
	// samples calls add for each of t's samples: its value and the values of labels ("" past
	// len(labels)).
	samples func(t *PortTraffic, add func(v float64, l1, l2 string))
}

// protoLabel is t's protocol as the series label it: a constant, so a scrape allocates nothing.
func protoLabel(t *PortTraffic) string {
	switch t.Protocol {
	case service.TCP:
		return "tcp"
	case service.UDP:
		return "udp"
	}
	return strings.ToLower(string(t.Protocol))
}

func (t *PortTraffic) udp() bool { return t.Observed && t.Protocol == service.UDP }
func (t *PortTraffic) tcp() bool { return t.Observed && t.Protocol != service.UDP }

// families are the traffic series, in the order of their names (as a registry exposes them).
var families = []family{
	{name: "drain_closed_total", help: "TCP connections or UDP sessions closed by their endpoint's drain deadline (service ports with a drain-timeout).",
		labels: []string{"protocol"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Observed && t.Drain {
				add(float64(t.Drained), protoLabel(t), "")
			}
		}},
	{name: "endpoints", help: "Endpoints the balancer uses for the service port.", gauge: true,
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Balanced {
				add(float64(t.Endpoints), "", "")
			}
		}},
	{name: "no_endpoint_rejects_total", help: "New connections (reset) or datagrams (dropped) with no endpoint to go to.",
		labels: []string{"protocol"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Observed {
				add(float64(t.Stats.NoEndpoint), protoLabel(t), "")
			}
		}},
	{name: "outlier_ejected_endpoints", help: "Endpoints out of rotation now by outlier detection (service ports with it on).", gauge: true,
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Outlier {
				add(float64(t.Ejected), "", "")
			}
		}},
	{name: "outlier_ejections_total", help: "Endpoints taken out of rotation by outlier detection (service ports with it on).",
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Outlier {
				add(float64(t.Ejections), "", "")
			}
		}},
	{name: "source_range_drops_total", help: "New connections (reset) or datagrams (dropped) from clients outside loadBalancerSourceRanges, checked by the socket in bind mode (iptables mode drops them in the kernel, uncounted here).",
		labels: []string{"protocol"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Observed {
				add(float64(t.Stats.SourceDenied), protoLabel(t), "")
			}
		}},
	{name: "tcp_bytes_total", help: "Bytes proxied over TCP; direction is to_endpoint (client to pod) or to_client.",
		labels: []string{"direction"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() {
				add(float64(t.Stats.BytesToEndpoint), "to_endpoint", "")
				add(float64(t.Stats.BytesToClient), "to_client", "")
			}
		}},
	{name: "tcp_connections_active", help: "Open proxied TCP connections.", gauge: true,
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() {
				add(float64(t.Stats.Active), "", "")
			}
		}},
	{name: "tcp_connections_total", help: "Accepted TCP connections.",
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() {
				add(float64(t.Stats.Total), "", "")
			}
		}},
	{name: "tcp_dial_attempts_total", help: "Dials to endpoints.",
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() {
				add(float64(t.Stats.DialAttempts), "", "")
			}
		}},
	{name: "tcp_dial_failures_total", help: "Dials to endpoints that failed.",
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() {
				add(float64(t.Stats.DialFailures), "", "")
			}
		}},
	{name: "tcp_dial_retries_total", help: "Dials that were retries after a failed one (affinity reset).",
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() {
				add(float64(t.Stats.DialRetries), "", "")
			}
		}},
	{name: "tcp_held_connections", help: "TCP connections held now for want of an endpoint (service ports with a hold-timeout).", gauge: true,
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() && t.Holds {
				add(float64(t.Stats.Held), "", "")
			}
		}},
	{name: "tcp_holds_total", help: "TCP connections that found no endpoint on a service port with a hold-timeout, by outcome: served (an endpoint appeared), timeout (reset at the hold timeout), full (not held: the hold limit was reached; reset), aborted (the proxy socket closed first), client-gone (the client reset, or closed without sending a byte, while held).",
		labels: []string{"outcome"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.tcp() && t.Holds {
				for o := range flow.NumHoldOutcomes {
					add(float64(t.Stats.Holds[o]), o.String(), "")
				}
			}
		}},
	{name: "transparent_dials_total", help: "Endpoint connections or UDP sessions of service ports in the transparent source mode, by result: transparent (dialed from the client's address and port) or fallback (the policy wanted it, the client's address could not be taken: dialed from the node's). Flows the policy keeps on the node's address (the replies would not pass this node, a host-network client or endpoint, hairpin) are not counted.",
		labels: []string{"protocol", "result"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.Observed && t.Transparent {
				add(float64(t.TransparentDials), protoLabel(t), "transparent")
				add(float64(t.TransparentFallbacks), protoLabel(t), "fallback")
			}
		}},
	{name: "udp_bytes_total", help: "Bytes proxied over UDP; direction is to_endpoint or to_client.",
		labels: []string{"direction"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.udp() {
				add(float64(t.Stats.BytesToEndpoint), "to_endpoint", "")
				add(float64(t.Stats.BytesToClient), "to_client", "")
			}
		}},
	{name: "udp_drops_total", help: "Datagrams dropped; reason is no_endpoint, session_setup, to_endpoint, to_client or truncated.",
		labels: []string{"reason"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.udp() {
				st := &t.Stats
				add(float64(st.NoEndpoint), "no_endpoint", "")
				add(float64(st.DropsSessionSetup), "session_setup", "")
				add(float64(st.DropsToEndpoint), "to_endpoint", "")
				add(float64(st.DropsToClient), "to_client", "")
				add(float64(st.DropsTruncated), "truncated", "")
			}
		}},
	{name: "udp_packets_total", help: "Datagrams proxied; direction is to_endpoint or to_client.",
		labels: []string{"direction"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.udp() {
				add(float64(t.Stats.PacketsToEndpoint), "to_endpoint", "")
				add(float64(t.Stats.PacketsToClient), "to_client", "")
			}
		}},
	{name: "udp_sessions_active", help: "Live UDP sessions.", gauge: true,
		samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.udp() {
				add(float64(t.Stats.Active), "", "")
			}
		}},
	{name: "udp_sessions_total", help: "Ended or created UDP sessions; event is created, expired, evicted, refused or closed.",
		labels: []string{"event"}, samples: func(t *PortTraffic, add func(float64, string, string)) {
			if t.udp() {
				st := &t.Stats
				add(float64(st.Total), "created", "")
				add(float64(st.Ended[flow.IdleTimeout]), "expired", "")
				add(float64(st.Ended[flow.Evicted]), "evicted", "")
				add(float64(st.Ended[flow.EndpointRefused]), "refused", "")
				add(float64(st.Ended[flow.EndpointRemoved]+st.Ended[flow.EndpointError]+st.Ended[flow.Shutdown]+st.Ended[flow.DrainTimeout]), "closed", "")
			}
		}},
}

// trafficCollector exports the data-path counters of every open proxy socket. The sockets keep
// their counters as atomics; this collector only reads them when Prometheus scrapes, so the data
// path pays nothing for metrics. Series of a removed service port disappear with it. Handler
// writes the same series as text without it (a registry's Gather made about 390 bytes of garbage
// per series); the collector serves the other formats and tests.
type trafficCollector struct {
	src   TrafficSource
	descs []*prometheus.Desc // per family
}

// NewTrafficCollector returns the per-service-port traffic collector of src.
func NewTrafficCollector(src TrafficSource) prometheus.Collector {
	c := &trafficCollector{src: src}
	for _, f := range families {
		c.descs = append(c.descs, prometheus.NewDesc(metricPrefix+f.name, f.help, append([]string{"service_port"}, f.labels...), nil))
	}
	return c
}

const metricPrefix = "kube_portal_proxy_"

func (c *trafficCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c *trafficCollector) Collect(ch chan<- prometheus.Metric) {
	// Read every port first: a send on ch waits for the registry, which must not hold up the
	// source's lock (see TrafficSource).
	var ports []PortTraffic
	for t := range c.src.Traffic() {
		ports = append(ports, t)
	}
	for _, t := range ports {
		name := t.Name.String()
		for i, f := range families {
			f.samples(&t, func(v float64, l1, l2 string) {
				vt := prometheus.CounterValue
				if f.gauge {
					vt = prometheus.GaugeValue
				}
				labels := []string{name, l1, l2}[:1+len(f.labels)]
				ch <- prometheus.MustNewConstMetric(c.descs[i], vt, v, labels...)
			})
		}
	}
}
