package daemon

import (
	"context"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe/conntrack"
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
		"Flow events (and captured payload pieces) observers of /debug/flows did not get, by reason: slow-observer (the ring overtook it), rate-cap (over its rate), capture-overflow (captured payload pieces dropped from a full queue).", []string{"reason"}, nil)
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

// kernelFlowsTask reads conntrack events for the kernel-path ports' flows, only while some port
// is on the kernel path: every NAT'ed flow of the node is an event, a cost worth paying only for
// flows the stream shows. A watcher that fails (no ctnetlink in this kernel or sandbox) is said
// once and started again only at the next change of the kernel-path ports, not in a loop.
func kernelFlowsTask(look proxier.KernelFlowLookup, log logrus.FieldLogger) func(context.Context) {
	return kernelFlowsLoop(look, func(ctx context.Context) error {
		return conntrack.NewWatcher(look, conntrack.Options{Logger: log}).Run(ctx)
	}, log)
}

// kernelFlowsLoop runs watch while the lookup has ports (kernelFlowsTask, with watch a
// conntrack watcher's Run).
func kernelFlowsLoop(look proxier.KernelFlowLookup, watch func(context.Context) error, log logrus.FieldLogger) func(context.Context) {
	return func(ctx context.Context) {
		var cur *watcherRun
		defer func() { cur.halt() }()
		failed := false // the last watcher failed: wait for a change before the next
		for {
			if cur.failed() {
				cur, failed = nil, true
			}
			switch n := look.Ports(); {
			case n > 0 && cur == nil && !failed:
				cur = startWatcher(ctx, watch, log)
			case n == 0:
				cur.halt()
				cur = nil
			}
			select {
			case <-ctx.Done():
				return
			case <-look.Changed():
				failed = false
			case <-cur.ended():
			}
		}
	}
}

// watcherRun is one conntrack watcher running in its own goroutine.
type watcherRun struct {
	stop context.CancelFunc
	done chan struct{}
}

func startWatcher(ctx context.Context, watch func(context.Context) error, log logrus.FieldLogger) *watcherRun {
	wctx, stop := context.WithCancel(ctx)
	r := &watcherRun{stop: stop, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		if err := watch(wctx); err != nil {
			log.WithError(err).Warn("Cannot read conntrack events: kernel-path flows are not in the flow stream until the kernel-path Services change")
		}
	}()
	return r
}

// halt stops the watcher and waits for its goroutine; nil does nothing.
func (r *watcherRun) halt() {
	if r != nil {
		r.stop()
		<-r.done
	}
}

// failed reports whether the watcher returned by itself.
func (r *watcherRun) failed() bool {
	if r == nil {
		return false
	}
	select {
	case <-r.done:
		r.stop()
		return true
	default:
		return false
	}
}

// ended is closed once the watcher returned; nil (never) without one.
func (r *watcherRun) ended() <-chan struct{} {
	if r == nil {
		return nil
	}
	return r.done
}
