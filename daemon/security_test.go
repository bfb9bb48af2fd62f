package daemon

// Address plan: the limited health server listens on 127.0.0.1 at a kernel-chosen port; the
// defaults are read from the flags, nothing listens on them.

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
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
