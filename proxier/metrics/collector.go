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

// TrafficSource lists the open service ports at a scrape: the proxier implements it.
type TrafficSource interface {
	Traffic() iter.Seq[PortTraffic]
}

// trafficCollector exports the data-path counters of every open proxy socket. The sockets keep
// their counters as atomics; this collector only reads them when Prometheus scrapes, so the data
// path pays nothing for metrics. Series of a removed service port disappear with it.
type trafficCollector struct {
	src TrafficSource

	tcpActive, tcpTotal, tcpBytes                    *prometheus.Desc
	dialAttempts, dialFailures, dialRetries, rejects *prometheus.Desc
	udpActive, udpSessions, udpPackets, udpBytes     *prometheus.Desc
	udpDrops, sourceDrops                            *prometheus.Desc
	endpoints                                        *prometheus.Desc
	ejections, ejected                               *prometheus.Desc
	held, holds                                      *prometheus.Desc
	drained                                          *prometheus.Desc
	transparent                                      *prometheus.Desc
}

// NewTrafficCollector returns the per-service-port traffic collector of src.
func NewTrafficCollector(src TrafficSource) prometheus.Collector {
	sp := []string{"service_port"}
	d := func(name, help string, extra ...string) *prometheus.Desc {
		return prometheus.NewDesc("kube_portal_proxy_"+name, help, append(sp, extra...), nil)
	}
	return &trafficCollector{
		src:          src,
		tcpActive:    d("tcp_connections_active", "Open proxied TCP connections."),
		tcpTotal:     d("tcp_connections_total", "Accepted TCP connections."),
		tcpBytes:     d("tcp_bytes_total", "Bytes proxied over TCP; direction is to_endpoint (client to pod) or to_client.", "direction"),
		dialAttempts: d("tcp_dial_attempts_total", "Dials to endpoints."),
		dialFailures: d("tcp_dial_failures_total", "Dials to endpoints that failed."),
		dialRetries:  d("tcp_dial_retries_total", "Dials that were retries after a failed one (affinity reset)."),
		rejects:      d("no_endpoint_rejects_total", "New connections (reset) or datagrams (dropped) with no endpoint to go to.", "protocol"),
		udpActive:    d("udp_sessions_active", "Live UDP sessions."),
		udpSessions:  d("udp_sessions_total", "Ended or created UDP sessions; event is created, expired, evicted, refused or closed.", "event"),
		udpPackets:   d("udp_packets_total", "Datagrams proxied; direction is to_endpoint or to_client.", "direction"),
		udpBytes:     d("udp_bytes_total", "Bytes proxied over UDP; direction is to_endpoint or to_client.", "direction"),
		udpDrops:     d("udp_drops_total", "Datagrams dropped; reason is no_endpoint, session_setup, to_endpoint, to_client or truncated.", "reason"),
		sourceDrops:  d("source_range_drops_total", "New connections (reset) or datagrams (dropped) from clients outside loadBalancerSourceRanges, checked by the socket in bind mode (iptables mode drops them in the kernel, uncounted here).", "protocol"),
		endpoints:    d("endpoints", "Endpoints the balancer uses for the service port."),
		ejections:    d("outlier_ejections_total", "Endpoints taken out of rotation by outlier detection (service ports with it on)."),
		ejected:      d("outlier_ejected_endpoints", "Endpoints out of rotation now by outlier detection (service ports with it on)."),
		held:         d("tcp_held_connections", "TCP connections held now for want of an endpoint (service ports with a hold-timeout)."),
		holds:        d("tcp_holds_total", "TCP connections that found no endpoint on a service port with a hold-timeout, by outcome: served (an endpoint appeared), timeout (reset at the hold timeout), full (not held: the hold limit was reached; reset), aborted (the proxy socket closed first), client-gone (the client reset, or closed without sending a byte, while held).", "outcome"),
		transparent:  d("transparent_dials_total", "Endpoint connections or UDP sessions of service ports in the transparent source mode, by result: transparent (dialed from the client's address and port) or fallback (the policy wanted it, the client's address could not be taken: dialed from the node's). Flows the policy keeps on the node's address (the replies would not pass this node, a host-network client or endpoint, hairpin) are not counted.", "protocol", "result"),
		drained:      d("drain_closed_total", "TCP connections or UDP sessions closed by their endpoint's drain deadline (service ports with a drain-timeout).", "protocol"),
	}
}

func (c *trafficCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.tcpActive, c.tcpTotal, c.tcpBytes, c.dialAttempts, c.dialFailures,
		c.dialRetries, c.rejects, c.udpActive, c.udpSessions, c.udpPackets, c.udpBytes, c.udpDrops, c.sourceDrops, c.endpoints,
		c.ejections, c.ejected, c.held, c.holds, c.drained, c.transparent} {
		ch <- d
	}
}

func (c *trafficCollector) Collect(ch chan<- prometheus.Metric) {
	for t := range c.src.Traffic() {
		name := t.Name.String()
		counter := func(d *prometheus.Desc, v float64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, append([]string{name}, labels...)...)
		}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, name)
		}
		if t.Balanced {
			gauge(c.endpoints, float64(t.Endpoints))
		}
		if t.Outlier {
			counter(c.ejections, float64(t.Ejections))
			gauge(c.ejected, float64(t.Ejected))
		}
		st, ok := t.Stats, t.Observed
		if ok && t.Drain {
			counter(c.drained, float64(t.Drained), strings.ToLower(string(t.Protocol)))
		}
		if ok && t.Transparent {
			proto := strings.ToLower(string(t.Protocol))
			counter(c.transparent, float64(t.TransparentDials), proto, "transparent")
			counter(c.transparent, float64(t.TransparentFallbacks), proto, "fallback")
		}
		switch {
		case !ok:
		case t.Protocol == service.UDP:
			gauge(c.udpActive, float64(st.Active))
			counter(c.udpSessions, float64(st.Total), "created")
			counter(c.udpSessions, float64(st.Ended[flow.IdleTimeout]), "expired")
			counter(c.udpSessions, float64(st.Ended[flow.Evicted]), "evicted")
			counter(c.udpSessions, float64(st.Ended[flow.EndpointRefused]), "refused")
			counter(c.udpSessions, float64(st.Ended[flow.EndpointRemoved]+st.Ended[flow.EndpointError]+st.Ended[flow.Shutdown]+st.Ended[flow.DrainTimeout]), "closed")
			counter(c.udpPackets, float64(st.PacketsToEndpoint), "to_endpoint")
			counter(c.udpPackets, float64(st.PacketsToClient), "to_client")
			counter(c.udpBytes, float64(st.BytesToEndpoint), "to_endpoint")
			counter(c.udpBytes, float64(st.BytesToClient), "to_client")
			counter(c.rejects, float64(st.NoEndpoint), "udp")
			counter(c.udpDrops, float64(st.NoEndpoint), "no_endpoint")
			counter(c.udpDrops, float64(st.DropsSessionSetup), "session_setup")
			counter(c.udpDrops, float64(st.DropsToEndpoint), "to_endpoint")
			counter(c.udpDrops, float64(st.DropsToClient), "to_client")
			counter(c.udpDrops, float64(st.DropsTruncated), "truncated")
			counter(c.sourceDrops, float64(st.SourceDenied), "udp")
		default:
			gauge(c.tcpActive, float64(st.Active))
			counter(c.tcpTotal, float64(st.Total))
			counter(c.tcpBytes, float64(st.BytesToEndpoint), "to_endpoint")
			counter(c.tcpBytes, float64(st.BytesToClient), "to_client")
			counter(c.dialAttempts, float64(st.DialAttempts))
			counter(c.dialFailures, float64(st.DialFailures))
			counter(c.dialRetries, float64(st.DialRetries))
			counter(c.rejects, float64(st.NoEndpoint), "tcp")
			counter(c.sourceDrops, float64(st.SourceDenied), "tcp")
			if t.Holds {
				gauge(c.held, float64(st.Held))
				for o := range flow.NumHoldOutcomes {
					counter(c.holds, float64(st.Holds[o]), o.String())
				}
			}
		}
	}
}
