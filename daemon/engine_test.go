package daemon

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"
	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

// Address plan: the echo endpoint and the proxy sockets on 127.0.0.1, the metrics server on
// 127.0.0.2 (kernel-chosen ports); the service's cluster IP only in the fake portal rules.

// TestIOEngine runs the daemon with each --io-engine and a probe that passes or fails (the seam:
// kernel.io_uring_disabled is global to the host, not ours to change): the service answers
// through the engine chosen, the metric names it, and a fallback is logged once with its reason.
func TestIOEngine(t *testing.T) {
	blocked := errors.New("io_uring_setup: operation not permitted")
	for _, tt := range []struct {
		name     string
		flag     string
		probe    error
		want     string
		fallback bool
	}{
		{"auto_takes_io_uring", "auto", nil, tcp.EngineIOUring, false},
		{"auto_falls_back_to_epoll_and_says_why", "auto", blocked, tcp.EngineEpoll, true},
		{"epoll_by_name", "epoll", nil, tcp.EngineEpoll, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.want == tcp.EngineIOUring {
				if err := tcp.ProbeIOUring(); err != nil {
					t.Skipf("io_uring unavailable here: %v", err)
				}
			}
			backend := echoServer(t)
			dir := t.TempDir()
			writeService(t, dir, "echo", "10.96.0.10", backend)
			h := newHarness(t, "--services-file="+dir, "--iptables-min-sync-period=0", "--io-engine="+tt.flag,
				"--healthz-bind-address=", "--metrics-bind-address=127.0.0.2:0")
			h.d.deps.probeIOUring = func() error {
				if tt.probe != nil {
					return tt.probe
				}
				return tcp.ProbeIOUring()
			}
			stop := h.start(t)
			port := h.portals.waitProxyPort(t, service.ServicePortName{Namespace: "default", Name: "echo", Port: "tcp"})
			addr := fmt.Sprintf("127.0.0.1:%d", port)
			if got, want := echo(t, addr), "hello through the proxy\n"; got != want {
				t.Errorf("echo through %s = %q, want %q", addr, got, want)
			}
			_, metrics := get(t, h.url(t, "127.0.0.2:0", "/metrics"))
			if want := fmt.Sprintf(`kube_portal_proxy_io_engine{engine=%q} 1`, tt.want); !strings.Contains(metrics, want) {
				t.Errorf("/metrics lacks %s", want)
			}
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			var warned []string
			for _, e := range h.log.AllEntries() {
				if e.Level == logrus.WarnLevel && strings.Contains(e.Message, "io_uring") {
					warned = append(warned, fmt.Sprintf("%s (%v)", e.Message, e.Data[logrus.ErrorKey]))
				}
			}
			switch {
			case tt.fallback && (len(warned) != 1 || !strings.Contains(warned[0], blocked.Error())):
				t.Errorf("fallback logged %q, want one warning with the reason %q", warned, blocked)
			case !tt.fallback && len(warned) > 0:
				t.Errorf("no fallback, but logged %q", warned)
			}
		})
	}
}

func TestIOEngineByNameFailsWithoutIOUring(t *testing.T) {
	h := newHarness(t, "--services-file="+t.TempDir(), "--io-engine=io_uring", "--healthz-bind-address=", "--metrics-bind-address=")
	h.d.deps.probeIOUring = func() error { return errors.New("io_uring_setup: function not implemented") }
	stop := h.start(t)
	err := stop()
	if err == nil || !strings.Contains(err.Error(), "--io-engine") || !strings.Contains(err.Error(), "function not implemented") {
		t.Errorf("Run = %v, want an error naming --io-engine and the probe's reason", err)
	}
}

func TestIOEngineFlagIsValidated(t *testing.T) {
	if _, _, err := parseOptions([]string{"--io-engine=uring"}); err == nil || !strings.Contains(err.Error(), "--io-engine") {
		t.Errorf("parseOptions(--io-engine=uring) = %v, want an error naming the flag", err)
	}
}

func TestIOEngineFromTheConfigFile(t *testing.T) {
	const head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	for _, tt := range []struct {
		name, file string
		args       []string
		want       string // the engine, or a substring of the error
		wantErr    bool
	}{
		{"field_sets_the_engine", head + "ioEngine: epoll\n", nil, "epoll", false},
		{"flag_overrides_the_field", head + "ioEngine: epoll\n", []string{"--io-engine=io_uring"}, "io_uring", false},
		{"absent_is_auto", head, nil, "auto", false},
		{"bad_value_names_the_field", head + "ioEngine: uring\n", nil, "field ioEngine", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := t.TempDir() + "/config.yaml"
			if err := os.WriteFile(path, []byte(tt.file), 0o600); err != nil {
				t.Fatal(err)
			}
			o, _, err := parseOptions(append([]string{"--config=" + path}, tt.args...))
			if tt.wantErr {
				if err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Errorf("parseOptions = %v, want an error with %q", err, tt.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.ioEngine != tt.want {
				t.Errorf("io engine %q, want %q", o.ioEngine, tt.want)
			}
			written, err := marshalConfig(o)
			if err != nil || !strings.Contains(string(written), "ioEngine: "+tt.want) {
				t.Errorf("--write-config-to lacks ioEngine: %s (%v)", written, err)
			}
		})
	}
}

// fakeEngine is an engine's status as the metrics and /healthz read it.
type fakeEngine struct {
	name string
	st   tcp.EngineStatus
}

func (f *fakeEngine) Name() string             { return f.name }
func (f *fakeEngine) Status() tcp.EngineStatus { return f.st }

// TestIOEngineFailuresInMetricsAndHealth: an io_uring engine that fell back to epoll (tcp's
// TestIOUring*FailureFallsBackToEpoll inject the failures into a real engine) says so in
// /metrics: the engine serving, and its failures by phase. A failed start is the probe's fallback
// found late: /healthz stays 200. A loop that died reset its connections: /healthz answers 503
// with the cause (/livez is the proxier's alone: healthMux).
func TestIOEngineFailuresInMetricsAndHealth(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "proxier healthy") })
	died := errors.New("an io_uring loop stopped: io_uring_enter: bad file descriptor")
	for _, tt := range []struct {
		name        string
		engine      fakeEngine
		wantMetrics string
		wantHealth  int
	}{
		{"io_uring_serving", fakeEngine{tcp.EngineIOUring, tcp.EngineStatus{Serving: tcp.EngineIOUring}}, `
kube_portal_proxy_io_engine{engine="io_uring"} 1
kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="run"} 0
kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="start"} 0
`, http.StatusOK},
		{"start_failed_fell_back", fakeEngine{tcp.EngineIOUring, tcp.EngineStatus{Serving: tcp.EngineEpoll, StartFailures: 1}}, `
kube_portal_proxy_io_engine{engine="epoll"} 1
kube_portal_proxy_io_engine{engine="io_uring"} 0
kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="run"} 0
kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="start"} 1
`, http.StatusOK},
		{"loop_died_fell_back", fakeEngine{tcp.EngineIOUring, tcp.EngineStatus{Serving: tcp.EngineEpoll, LoopFailures: 1, Err: died}}, `
kube_portal_proxy_io_engine{engine="epoll"} 1
kube_portal_proxy_io_engine{engine="io_uring"} 0
kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="run"} 1
kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="start"} 0
`, http.StatusServiceUnavailable},
		{"epoll_by_name", fakeEngine{tcp.EngineEpoll, tcp.EngineStatus{Serving: tcp.EngineEpoll}}, `
kube_portal_proxy_io_engine{engine="epoll"} 1
`, http.StatusOK},
	} {
		t.Run(tt.name, func(t *testing.T) {
			reg := prometheus.NewPedanticRegistry()
			reg.MustRegister(engineCollector(&tt.engine))
			got, err := testutil.CollectAndFormat(reg, expfmt.TypeTextPlain, "kube_portal_proxy_io_engine", "kube_portal_proxy_io_engine_failures_total")
			if err != nil {
				t.Fatal(err)
			}
			var series []string
			for _, line := range strings.Split(string(got), "\n") {
				if line != "" && !strings.HasPrefix(line, "#") {
					series = append(series, line)
				}
			}
			if diff := cmp.Diff(strings.TrimSpace(tt.wantMetrics), strings.Join(series, "\n")); diff != "" {
				t.Errorf("/metrics (-want +got):\n%s", diff)
			}

			rec := httptest.NewRecorder()
			engineHealthz(&tt.engine, ok).ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
			if rec.Code != tt.wantHealth {
				t.Errorf("/healthz = %d %q, want %d", rec.Code, rec.Body, tt.wantHealth)
			}
			if tt.engine.st.Err != nil && !strings.Contains(rec.Body.String(), died.Error()) {
				t.Errorf("/healthz body %q does not give the cause %q", rec.Body, died)
			}
		})
	}
}
