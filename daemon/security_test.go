package daemon

// Address plan: the limited health server listens on 127.0.0.1 at a kernel-chosen port; the
// daemons started here serve their metrics address on 127.0.0.2 and their metrics-only address
// on 127.0.0.3, at kernel-chosen ports; the defaults are read from the flags, nothing listens on
// them.

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
)

// TestNodeFacingDefaults: by default only the health address listens beyond loopback, and it
// serves /healthz and /livez alone; the metrics address, which carries the status page, the
// debug pages (client addresses, live connections, the rules) and pprof, is loopback, as
// kube-proxy's metrics address is.
func TestNodeFacingDefaults(t *testing.T) {
	o, err := ParseOptions(nil)
	if err != nil {
		t.Fatal(err)
	}
	metrics, err := netip.ParseAddrPort(o.metricsBindAddress)
	if err != nil || !metrics.Addr().IsLoopback() {
		t.Errorf("default --metrics-bind-address %q: want a loopback address", o.metricsBindAddress)
	}
	if o.healthzBindAddress != "0.0.0.0:10256" {
		t.Errorf("default --healthz-bind-address %q: want kube-proxy's 0.0.0.0:10256", o.healthzBindAddress)
	}
	if o.metricsOnlyBindAddress != "" || o.profiling {
		t.Errorf("default --metrics-only-bind-address %q, --profiling %v: want none and off", o.metricsOnlyBindAddress, o.profiling)
	}
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	mux := healthMux(ok, ok)
	for path, want := range map[string]int{
		"/healthz": 200, "/livez": 200,
		"/": 404, "/metrics": 404, "/proxyMode": 404, "/debug/services": 404, "/debug/connections": 404,
		"/debug/rules": 404, "/debug/pprof/": 404, "/debug/pprof/cmdline": 404,
	} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		if rec.Code != want {
			t.Errorf("health address %s = %d, want %d", path, rec.Code, want)
		}
	}
}

// TestHealthAddressIsLimited: the health address faces load balancers and anyone on the node's
// network, so it takes the health check ports' limits (healthcheck.Limits); the metrics address
// does not (pprof's profile streams for 30 s).
func TestHealthAddressIsLimited(t *testing.T) {
	for _, tc := range []struct {
		name    string
		limited bool
		want    int
	}{
		{"health address refuses oversized headers", true, http.StatusRequestHeaderFieldsTooLarge},
		{"metrics address keeps net/http's limits", false, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp4", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			log := logrus.New()
			log.SetOutput(io.Discard)
			go func() {
				defer close(done)
				serveHTTP(ln, httpServer{addr: ln.Addr().String(), handler: ok, limited: tc.limited}, log)(ctx)
			}()
			defer func() { cancel(); <-done }()

			c, err := net.DialTimeout("tcp4", ln.Addr().String(), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			req := "GET /healthz HTTP/1.1\r\nHost: node\r\nX-Pad: " + strings.Repeat("a", 16<<10) + "\r\n\r\n"
			if _, err := io.WriteString(c, req); err != nil {
				t.Fatal(err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("a 16 KiB header got %d, want %d", resp.StatusCode, tc.want)
			}
		})
	}
}

// startDaemonHTTP starts a daemon on an empty services directory with args and waits for its
// first sync, by when its HTTP servers listen.
func startDaemonHTTP(t *testing.T, args ...string) *harness {
	t.Helper()
	h := newHarness(t, append([]string{"--services-file=" + t.TempDir(), "--healthz-bind-address="}, args...)...)
	h.start(t)
	h.portals.waitSync(t)
	return h
}

// TestProfilingOffUnlessEnabled: pprof is served on the metrics address only when asked for,
// by --profiling or the file's enableProfiling (kube-proxy's), never by default.
func TestProfilingOffUnlessEnabled(t *testing.T) {
	profilingFile := writeTemp(t, "config.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nenableProfiling: true\n")
	offFile := writeTemp(t, "off.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nenableProfiling: false\n")
	for _, tc := range []struct {
		name string
		args []string
		want int
	}{
		{"off by default", nil, http.StatusNotFound},
		{"off in the file", []string{"--config=" + offFile}, http.StatusNotFound},
		{"on with --profiling", []string{"--profiling"}, http.StatusOK},
		{"on with enableProfiling", []string{"--config=" + profilingFile}, http.StatusOK},
		{"the flag overrides the file", []string{"--config=" + profilingFile, "--profiling=false"}, http.StatusNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := startDaemonHTTP(t, append([]string{"--metrics-bind-address=127.0.0.2:0"}, tc.args...)...)
			for _, path := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/symbol"} {
				if code, _ := get(t, h.url(t, "127.0.0.2:0", path)); code != tc.want {
					t.Errorf("GET %s = %d, want %d", path, code, tc.want)
				}
			}
			if code, _ := get(t, h.url(t, "127.0.0.2:0", "/metrics")); code != http.StatusOK {
				t.Errorf("GET /metrics = %d, want 200 whatever the profiling", code)
			}
		})
	}
}

// TestMetricsOnlyAddress: --metrics-only-bind-address is what a scraper off the node is given:
// it serves /metrics and nothing else (no debug page, no client address, no pprof, even with
// --profiling on the metrics address), within the health address's limits.
func TestMetricsOnlyAddress(t *testing.T) {
	h := startDaemonHTTP(t, "--metrics-bind-address=127.0.0.2:0", "--metrics-only-bind-address=127.0.0.3:0", "--profiling")
	code, body := get(t, h.url(t, "127.0.0.3:0", "/metrics"))
	if code != http.StatusOK || !strings.Contains(body, "kubeproxy_sync_proxy_rules_last_timestamp_seconds ") || !strings.Contains(body, "go_goroutines ") {
		t.Errorf("metrics-only GET /metrics = %d, want 200 with the proxy's and Go's series:\n%.500s", code, body)
	}
	for _, path := range []string{"/", "/proxyMode", "/healthz", "/debug/connections", "/debug/services", "/debug/rules",
		"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/profile?seconds=1"} {
		if code, _ := get(t, h.url(t, "127.0.0.3:0", path)); code != http.StatusNotFound {
			t.Errorf("metrics-only GET %s = %d, want 404", path, code)
		}
		// The metrics address on loopback still serves them (the test's premise).
		if path == "/debug/connections" || path == "/debug/pprof/" {
			if code, _ := get(t, h.url(t, "127.0.0.2:0", path)); code != http.StatusOK {
				t.Errorf("metrics address GET %s = %d, want 200", path, code)
			}
		}
	}
	// Limited as the health address is: an oversized header is refused.
	c, err := net.DialTimeout("tcp4", strings.TrimPrefix(h.url(t, "127.0.0.3:0", ""), "http://"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "GET /metrics HTTP/1.1\r\nHost: node\r\nX-Pad: "+strings.Repeat("a", 16<<10)+"\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("metrics-only address: a 16 KiB header got %d, want 431", resp.StatusCode)
	}
}

// TestMetricsOnlyAddressSettings: the address comes from the flag or the file's own field
// metricsOnlyBindAddress, is checked as ip:port, and --write-config-to keeps it.
func TestMetricsOnlyAddressSettings(t *testing.T) {
	file := writeTemp(t, "config.conf", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmetricsOnlyBindAddress: 0.0.0.0:10251\n")
	o, err := ParseOptions([]string{"--config=" + file})
	if err != nil {
		t.Fatal(err)
	}
	if o.metricsOnlyBindAddress != "0.0.0.0:10251" || len(o.configIgnored) > 0 {
		t.Errorf("from the file: %q (ignored %q), want 0.0.0.0:10251", o.metricsOnlyBindAddress, o.configIgnored)
	}
	if _, err := ParseOptions([]string{"--metrics-only-bind-address=0.0.0.0"}); err == nil || !strings.Contains(err.Error(), "--metrics-only-bind-address") {
		t.Errorf("an address without a port: %v, want an error naming --metrics-only-bind-address", err)
	}
	out := filepath.Join(t.TempDir(), "written.conf")
	w, err := ParseOptions([]string{"--metrics-only-bind-address=0.0.0.0:10251", "--profiling", "--write-config-to=" + out})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.WriteConfig("test"); err != nil {
		t.Fatal(err)
	}
	back, err := ParseOptions([]string{"--config=" + out})
	if err != nil {
		t.Fatal(err)
	}
	if back.metricsOnlyBindAddress != "0.0.0.0:10251" || !back.profiling {
		t.Errorf("--write-config-to then --config: metrics-only %q, profiling %v; want 0.0.0.0:10251 and on", back.metricsOnlyBindAddress, back.profiling)
	}
}
