package proxier

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// fuzzAnnotations are the per-Service annotations in the order FuzzServiceAnnotations takes
// their values.
var fuzzAnnotations = []string{
	AnnotationAlgorithm, AnnotationOutlierConsecutiveFailures, AnnotationOutlierEjectionTime,
	AnnotationOutlierMaxEjectionPercent, AnnotationSlowStart, AnnotationDrainTimeout,
	AnnotationProxyProtocol, AnnotationHoldTimeout, AnnotationAccessLog, AnnotationDataPath,
}

// maxAnnotationError bounds the message of one annotation error: it becomes a Warning event on
// the Service and a log line, and an annotation value may be 256 KiB.
const maxAnnotationError = 1024

// FuzzServiceAnnotations converts a Service with any values of its portal-proxy.kubernetes.io/
// annotations (each present or not, per bit of set). A bad value must never take the Service
// down or half apply: both ports are still served, the field takes its default, and exactly one
// error wrapping ErrInvalidAnnotation names the key; a good value applies with no error. What is
// good is the documented contract (docs/annotations.md), written out here independently of the parsers.
func FuzzServiceAnnotations(f *testing.F) {
	f.Add(uint16(0x3ff), "least-connections", "5", "30s", "50%", "10s", "60s", "v2", "1m", "true", "kernel")
	f.Add(uint16(0x3ff), " random-two-choices ", "1000", "1h", "100", "1h", "24h", " v1", "1s", "false", " proxy ")
	f.Add(uint16(0x3ff), "LeastConnections", "0", "0.5s", "0", "999ms", "25h", "V1", "59m60s", "yes", "Kernel")
	f.Add(uint16(0x0ff), "", "-1", "1e3s", "101", "-1s", "1", "v3", "forever", "", "")
	f.Add(uint16(0x306), "x", "1001", "3600s", "50 %", "1h0m1s", "86400s", "true", "1h", "TRUE", "")
	f.Add(uint16(0x040), "", "", "", "", "", "", strings.Repeat("v", 10000), "", "", "")
	f.Add(uint16(0x200), "", "", "", "", "", "", "", "", "", strings.Repeat("k", 10000))
	f.Fuzz(func(t *testing.T, set uint16, algorithm, consecutive, ejection, maxPercent, slowStart, drain, proxyProto, hold, accessLog, dataPath string) {
		values := []string{algorithm, consecutive, ejection, maxPercent, slowStart, drain, proxyProto, hold, accessLog, dataPath}
		ann := map[string]string{}
		for i, key := range fuzzAnnotations {
			if set&(1<<i) != 0 {
				ann[key] = values[i]
			}
		}
		svc := &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", Annotations: ann},
			Spec:       v1.ServiceSpec{ClusterIP: "10.96.0.10", Ports: []v1.ServicePort{tcpPort("http", 80), udpPort("dns", 53)}},
		}
		ports, errs := convertService(svc)
		if len(ports) != 2 {
			t.Fatalf("annotations %q: %d ports served, want both: %v", ann, len(ports), errs)
		}
		tcp, udp := ports[0], ports[1]

		want := expectAnnotations(ann)
		var flagged []string
		for _, err := range errs {
			if !errors.Is(err, ErrInvalidAnnotation) {
				t.Fatalf("annotations %q: an error that is not about an annotation: %v", ann, err)
			}
			if len(err.Error()) > maxAnnotationError {
				t.Fatalf("annotation error of %d bytes, want at most %d: %.200s...", len(err.Error()), maxAnnotationError, err)
			}
			// The key is the first thing after "annotation " (the value, quoted, may say anything).
			_, rest, _ := strings.Cut(err.Error(), "annotation ")
			for _, key := range fuzzAnnotations {
				if strings.HasPrefix(rest, key+"=") {
					flagged = append(flagged, key)
				}
			}
		}
		if got, wantBad := strings.Join(flagged, " "), strings.Join(want.bad, " "); got != wantBad {
			t.Fatalf("annotations %q: errors name %q, want %q: %v", ann, got, wantBad, errs)
		}
		if tcp.Balancing != want.balancing || udp.Balancing != want.balancing {
			t.Fatalf("annotations %q: balancing %+v / %+v, want %+v", ann, tcp.Balancing, udp.Balancing, want.balancing)
		}
		if tcp.DrainTimeout != want.drain || udp.DrainTimeout != want.drain {
			t.Fatalf("annotations %q: drain timeout %v, want %v", ann, tcp.DrainTimeout, want.drain)
		}
		if tcp.ProxyProtocol != want.proxyProto || tcp.HoldTimeout != want.hold {
			t.Fatalf("annotations %q: TCP port proxy protocol %q hold %v, want %q %v", ann, tcp.ProxyProtocol, tcp.HoldTimeout, want.proxyProto, want.hold)
		}
		if udp.ProxyProtocol != "" || udp.HoldTimeout != 0 {
			t.Fatalf("annotations %q: the UDP port took proxy protocol %q hold %v", ann, udp.ProxyProtocol, udp.HoldTimeout)
		}
		if tcp.AccessLog != want.accessLog || udp.AccessLog != want.accessLog {
			t.Fatalf("annotations %q: access log %v, want %v", ann, tcp.AccessLog, want.accessLog)
		}
		if tcp.DataPath != want.dataPath || udp.DataPath != want.dataPath {
			t.Fatalf("annotations %q: data path %q / %q, want %q", ann, tcp.DataPath, udp.DataPath, want.dataPath)
		}
	})
}

// expected is what a Service's annotations must give, by the documented contract.
type expected struct {
	balancing  service.Balancing
	drain      time.Duration
	proxyProto service.ProxyProtocol
	hold       time.Duration
	accessLog  bool
	dataPath   service.DataPath // "": the node's default
	bad        []string         // the keys whose value is rejected, in fuzzAnnotations order; a PROXY
	// protocol asked of a Service with a UDP port is reported for that port too.
}

func expectAnnotations(ann map[string]string) expected {
	var e expected
	value := func(key string) (string, bool) {
		v, ok := ann[key]
		return strings.TrimSpace(v), ok
	}
	duration := func(key string, lo, hi time.Duration) (time.Duration, bool) {
		v, ok := value(key)
		if !ok {
			return 0, false
		}
		d, err := time.ParseDuration(v)
		if err != nil || d < lo || d > hi {
			e.bad = append(e.bad, key)
			return 0, false
		}
		return d, true
	}
	integer := func(key, v string, lo, hi int) (int, bool) {
		n, err := strconv.Atoi(v)
		if err != nil || n < lo || n > hi {
			e.bad = append(e.bad, key)
			return 0, false
		}
		return n, true
	}
	if v, ok := value(AnnotationDataPath); ok {
		switch d := service.DataPath(v); d {
		case service.DataPathProxy, service.DataPathKernel:
			e.dataPath = d
		default:
			e.bad = append(e.bad, AnnotationDataPath)
		}
	}
	if v, ok := value(AnnotationAlgorithm); ok {
		switch a := service.Algorithm(v); a {
		case service.RoundRobin, service.LeastConnections, service.RandomTwoChoices:
			e.balancing.Algorithm = a
		default:
			e.bad = append(e.bad, AnnotationAlgorithm)
		}
	}
	o := service.Outlier{EjectionTime: service.DefaultEjectionTime, MaxEjectionPercent: service.DefaultMaxEjectionPercent}
	if v, ok := value(AnnotationOutlierConsecutiveFailures); ok {
		o.ConsecutiveFailures, _ = integer(AnnotationOutlierConsecutiveFailures, v, 1, 1000)
	}
	if d, ok := duration(AnnotationOutlierEjectionTime, time.Second, time.Hour); ok {
		o.EjectionTime = d
	}
	if v, ok := value(AnnotationOutlierMaxEjectionPercent); ok {
		if n, ok := integer(AnnotationOutlierMaxEjectionPercent, strings.TrimSpace(strings.TrimSuffix(v, "%")), 1, 100); ok {
			o.MaxEjectionPercent = n
		}
	}
	if o.ConsecutiveFailures > 0 {
		e.balancing.Outlier = o
	}
	e.balancing.SlowStart, _ = duration(AnnotationSlowStart, time.Second, time.Hour)
	e.drain, _ = duration(AnnotationDrainTimeout, time.Second, 24*time.Hour)
	if v, ok := value(AnnotationProxyProtocol); ok {
		switch pp := service.ProxyProtocol(v); pp {
		case service.ProxyProtocolV1, service.ProxyProtocolV2:
			e.proxyProto = pp
		default:
			e.bad = append(e.bad, AnnotationProxyProtocol)
		}
	}
	e.hold, _ = duration(AnnotationHoldTimeout, time.Second, time.Hour)
	if v, ok := value(AnnotationAccessLog); ok {
		switch v {
		case "true":
			e.accessLog = true
		case "false":
		default:
			e.bad = append(e.bad, AnnotationAccessLog)
		}
	}
	if e.proxyProto != "" {
		e.bad = append(e.bad, AnnotationProxyProtocol) // the UDP port "dns" does not take it
	}
	return e
}
