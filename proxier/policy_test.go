package proxier

// Address plan: Service ns/web at 10.96.0.10:80, endpoints 10.0.0.<n>:8080; nothing is dialled.

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func annotated(kv ...string) func(*v1.Service) {
	return func(s *v1.Service) {
		s.Annotations = map[string]string{}
		for i := 0; i+1 < len(kv); i += 2 {
			s.Annotations[kv[i]] = kv[i+1]
		}
	}
}

func TestConvertBalancingAnnotations(t *testing.T) {
	tests := []struct {
		name    string
		kv      []string
		want    service.Balancing
		wantErr string // substring of the one error; "" for none
	}{
		{name: "unset_is_round_robin", want: service.Balancing{}},
		{name: "round_robin", kv: []string{AnnotationAlgorithm, "round-robin"}, want: service.Balancing{Algorithm: service.RoundRobin}},
		{name: "least_connections", kv: []string{AnnotationAlgorithm, "least-connections"}, want: service.Balancing{Algorithm: service.LeastConnections}},
		{name: "random_two_choices_with_spaces", kv: []string{AnnotationAlgorithm, " random-two-choices "}, want: service.Balancing{Algorithm: service.RandomTwoChoices}},
		{name: "unknown_algorithm_falls_back", kv: []string{AnnotationAlgorithm, "leastconn"},
			want: service.Balancing{}, wantErr: `portal-proxy.kubernetes.io/algorithm="leastconn"`},
		{name: "wrong_case_falls_back", kv: []string{AnnotationAlgorithm, "Round-Robin"},
			want: service.Balancing{}, wantErr: "want round-robin, least-connections or random-two-choices"},
		{name: "outlier_failures_turn_detection_on_with_defaults", kv: []string{AnnotationOutlierConsecutiveFailures, "3"},
			want: service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 3, EjectionTime: 30 * time.Second, MaxEjectionPercent: 50}}},
		{name: "outlier_all_set", kv: []string{AnnotationOutlierConsecutiveFailures, "5", AnnotationOutlierEjectionTime, "1m30s", AnnotationOutlierMaxEjectionPercent, "20"},
			want: service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 5, EjectionTime: 90 * time.Second, MaxEjectionPercent: 20}}},
		{name: "outlier_percent_sign_accepted", kv: []string{AnnotationOutlierConsecutiveFailures, "1", AnnotationOutlierMaxEjectionPercent, "100%"},
			want: service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 1, EjectionTime: 30 * time.Second, MaxEjectionPercent: 100}}},
		{name: "outlier_settings_without_failures_do_nothing", kv: []string{AnnotationOutlierEjectionTime, "10s"}, want: service.Balancing{}},
		{name: "outlier_bad_failures_leave_it_off", kv: []string{AnnotationOutlierConsecutiveFailures, "three"},
			want: service.Balancing{}, wantErr: "outlier detection stays off"},
		{name: "outlier_zero_failures_rejected", kv: []string{AnnotationOutlierConsecutiveFailures, "0"},
			want: service.Balancing{}, wantErr: "from 1 to 1000"},
		{name: "outlier_bad_time_uses_default", kv: []string{AnnotationOutlierConsecutiveFailures, "2", AnnotationOutlierEjectionTime, "30"},
			want:    service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 2, EjectionTime: 30 * time.Second, MaxEjectionPercent: 50}},
			wantErr: "want a duration from 1s to 1h"},
		{name: "outlier_too_short_time_uses_default", kv: []string{AnnotationOutlierConsecutiveFailures, "2", AnnotationOutlierEjectionTime, "10ms"},
			want:    service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 2, EjectionTime: 30 * time.Second, MaxEjectionPercent: 50}},
			wantErr: "outlier-ejection-time"},
		{name: "slow_start", kv: []string{AnnotationSlowStart, "30s"}, want: service.Balancing{SlowStart: 30 * time.Second}},
		{name: "slow_start_bad_stays_off", kv: []string{AnnotationSlowStart, "soon"},
			want: service.Balancing{}, wantErr: "slow start stays off"},
		{name: "slow_start_too_long_stays_off", kv: []string{AnnotationSlowStart, "2h"},
			want: service.Balancing{}, wantErr: "portal-proxy.kubernetes.io/slow-start=\"2h\""},
		{name: "outlier_bad_percent_uses_default", kv: []string{AnnotationOutlierConsecutiveFailures, "2", AnnotationOutlierMaxEjectionPercent, "150"},
			want:    service.Balancing{Outlier: service.Outlier{ConsecutiveFailures: 2, EjectionTime: 30 * time.Second, MaxEjectionPercent: 50}},
			wantErr: "from 1 to 100"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ports, errs := convertService(webService(annotated(tc.kv...)))
			if len(ports) != 1 {
				t.Fatalf("ports = %v, want one: a bad annotation must not drop the port", ports)
			}
			if got := ports[0].Balancing; got != tc.want {
				t.Errorf("Balancing = %+v, want %+v", got, tc.want)
			}
			switch {
			case tc.wantErr == "" && len(errs) != 0:
				t.Errorf("errors = %v, want none", errs)
			case tc.wantErr != "" && (len(errs) != 1 || !strings.Contains(errs[0].Error(), tc.wantErr) || !errors.Is(errs[0], ErrInvalidAnnotation)):
				t.Errorf("errors = %v, want one ErrInvalidAnnotation containing %q", errs, tc.wantErr)
			}
		})
	}
}

func TestInvalidAnnotationWarnsOncePerNewValue(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	var events []string
	e.p.deps.Event = func(n service.ServicePortName, reason, msg string) {
		events = append(events, n.String()+" "+reason+" "+msg)
	}
	bad := webService(annotated(AnnotationAlgorithm, "fastest"))
	e.p.OnServiceAdd(bad)
	e.p.OnServiceUpdate(nil, bad) // a resync: same value, no second event
	e.p.OnServiceUpdate(nil, webService(annotated(AnnotationAlgorithm, "least-connections")))
	e.p.OnServiceUpdate(nil, webService(annotated(AnnotationAlgorithm, "slowest")))
	e.p.OnServiceUpdate(nil, webService(annotated(AnnotationAlgorithm, "slowest")))
	if len(events) != 2 || !strings.HasPrefix(events[0], "ns/web InvalidAnnotation ") ||
		!strings.Contains(events[0], `"fastest"`) || !strings.Contains(events[1], `"slowest"`) {
		t.Errorf("events = %q, want one InvalidAnnotation event on ns/web for each new bad value", events)
	}
}

func TestBalancingReachesBalancerAndDebugView(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(webService(annotated(AnnotationAlgorithm, "least-connections")))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.0.0.1", "10.0.0.2"))
	e.sync()
	b := e.lb.Lookup(webHTTP)
	if b == nil || b.Balancing().Algorithm != service.LeastConnections {
		t.Fatalf("balancer of %s: %+v, want least-connections", webHTTP, b)
	}
	if _, err := b.Next(netip.MustParseAddr("192.168.0.1"), false); err != nil {
		t.Fatal(err)
	}
	views := e.p.Services()
	if len(views) != 1 || views[0].Balancing.Algorithm != "least-connections" {
		t.Fatalf("Services() = %+v, want one least-connections port", views)
	}
	var active []int64
	for _, ev := range views[0].Endpoints {
		active = append(active, ev.Active)
	}
	slices.Sort(active)
	if !slices.Equal(active, []int64{0, 1}) {
		t.Errorf("endpoint active counts = %v, want [0 1] after one pick", active)
	}
	// Back to the default when the annotation goes.
	e.p.OnServiceUpdate(nil, webService(nil))
	if got := e.lb.Lookup(webHTTP).Balancing().Algorithm; got != service.RoundRobin {
		t.Errorf("after the annotation was removed: %q, want round-robin", got)
	}
	if got := e.p.Services()[0].Balancing.Algorithm; got != "round-robin" {
		t.Errorf("debug view after removal: %q, want round-robin", got)
	}
}

func TestEjectionIsLoggedEventedCountedAndShown(t *testing.T) {
	logger, hook := logtest.NewNullLogger()
	e := newFakeEnv(t, func(c *Config) { c.Logger = logger })
	e.synced()
	var events []string
	e.p.deps.Event = func(n service.ServicePortName, reason, msg string) {
		events = append(events, n.String()+" "+reason+" "+msg)
	}
	e.p.OnServiceAdd(webService(annotated(AnnotationOutlierConsecutiveFailures, "2", AnnotationOutlierEjectionTime, "45s")))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.0.0.1", "10.0.0.2"))
	e.sync()
	b := e.lb.Lookup(webHTTP)
	bad := netip.MustParseAddrPort("10.0.0.1:8080")
	for range 2 { // as the TCP proxy reports two refused dials to 10.0.0.1
		b.DialDone(bad, errors.New("connection refused"))
	}
	want := []string{"ns/web:http EndpointEjected endpoint 10.0.0.1:8080 ejected for 45s after 2 failed dials (ejection 1 in a row)"}
	if !slices.Equal(events, want) {
		t.Errorf("events (-want +got)\n- %q\n+ %q", want, events)
	}
	var logged *logrus.Entry
	for _, entry := range hook.AllEntries() {
		if entry.Level == logrus.WarnLevel && strings.Contains(entry.Message, "ejected") {
			logged = entry
		}
	}
	if logged == nil || logged.Data["service"] != "ns/web:http" || logged.Data["endpoint"] != "10.0.0.1:8080" || logged.Data["ejected_for"] != "45s" {
		t.Errorf("ejection log line = %+v, want service, endpoint and ejected_for fields", logged)
	}
	wantSeries := `
# HELP kube_portal_proxy_outlier_ejected_endpoints Endpoints out of rotation now by outlier detection (service ports with it on).
# TYPE kube_portal_proxy_outlier_ejected_endpoints gauge
kube_portal_proxy_outlier_ejected_endpoints{service_port="ns/web:http"} 1
# HELP kube_portal_proxy_outlier_ejections_total Endpoints taken out of rotation by outlier detection (service ports with it on).
# TYPE kube_portal_proxy_outlier_ejections_total counter
kube_portal_proxy_outlier_ejections_total{service_port="ns/web:http"} 1
`
	if err := testutil.CollectAndCompare(metrics.NewTrafficCollector(e.p), strings.NewReader(wantSeries),
		"kube_portal_proxy_outlier_ejected_endpoints", "kube_portal_proxy_outlier_ejections_total"); err != nil {
		t.Error(err)
	}
	views := e.p.Services()
	if len(views) != 1 {
		t.Fatalf("Services() = %+v, want one", views)
	}
	v := views[0]
	if v.Balancing != (debugview.BalancingView{Algorithm: "round-robin", OutlierConsecutiveFailures: 2, OutlierEjectionTime: "45s", OutlierMaxEjectionPercent: 50}) {
		t.Errorf("balancing view = %+v", v.Balancing)
	}
	var ejected []string
	for _, ev := range v.Endpoints {
		if ev.EjectedFor != "" {
			ejected = append(ejected, ev.Address+" "+ev.EjectedFor)
		}
	}
	if want := []string{"10.0.0.1:8080 45s"}; !slices.Equal(ejected, want) {
		t.Errorf("ejected endpoints in the view = %q, want %q", ejected, want)
	}
	// The clock runs on: it is back in rotation, and the view says so.
	e.clk.Step(45 * time.Second)
	for _, ev := range e.p.Services()[0].Endpoints {
		if ev.EjectedFor != "" {
			t.Errorf("%s still shown ejected (%s) after its ejection time", ev.Address, ev.EjectedFor)
		}
	}
}

func TestSlowStartShownWhileAnEndpointWarms(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.synced()
	e.p.OnServiceAdd(webService(annotated(AnnotationSlowStart, "100s")))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.0.0.1"))
	e.sync()
	e.p.OnEndpointSliceUpdate(nil, webSlice("web-1", 8080, "10.0.0.1", "10.0.0.2")) // a new pod
	e.clk.Step(40 * time.Second)
	v := e.p.Services()[0]
	if v.Balancing.SlowStart != "1m40s" {
		t.Errorf("balancing view = %+v, want slowStart 1m40s", v.Balancing)
	}
	var warming []string
	for _, ev := range v.Endpoints {
		warming = append(warming, fmt.Sprintf("%s=%d", ev.Address, ev.WarmingPercent))
	}
	if want := []string{"10.0.0.1:8080=0", "10.0.0.2:8080=40"}; !slices.Equal(warming, want) {
		t.Errorf("warming percent per endpoint = %q, want %q", warming, want)
	}
}
