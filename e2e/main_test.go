package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

// EnvBinary names a prebuilt kube-portal-proxy binary to test instead of building one; a relative
// path is relative to the repository root (go test runs in e2e/).
const EnvBinary = "KPP_BINARY"

// The package shares one control plane and one proxy binary; TestMain sets them up.
var (
	controlPlane *framework.ControlPlane
	proxyBinary  string
	// noRoot and noControlPlane say why scenarios cannot run here, or are "".
	noRoot, noControlPlane string
)

func TestMain(m *testing.M) { os.Exit(runTests(m)) }

func runTests(m *testing.M) int {
	if os.Geteuid() != 0 {
		noRoot = "needs root for network namespaces and iptables (run the e2e tests as root)"
		return runOrRefuse(m, noRoot)
	}
	tmp, err := os.MkdirTemp("", "kpp-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer os.RemoveAll(tmp)
	if proxyBinary, err = findProxyBinary(tmp); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}

	bins, err := framework.FindBinaries()
	if errors.Is(err, framework.ErrBinariesMissing) {
		// The standalone --services-file scenario still runs.
		noControlPlane = err.Error()
		return runOrRefuse(m, noControlPlane)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), framework.DefaultStartTimeout)
	defer cancel()
	start := time.Now()
	cp, err := framework.Start(ctx, framework.Options{Binaries: bins, Dir: filepath.Join(tmp, "controlplane")})
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: start control plane:", err)
		return 1
	}
	defer func() {
		if err := cp.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stop control plane:", err)
		}
	}()
	fmt.Printf("e2e: control plane %s ready in %v; proxy binary %s\n", cp.Server, time.Since(start).Round(time.Millisecond), proxyBinary)
	controlPlane = cp

	code := m.Run()
	if code != 0 {
		fmt.Fprintf(os.Stderr, "e2e: control plane logs:\n%s\n", cp.LogTail(10))
	}
	return code
}

// runOrRefuse runs the tests so each reports why it skips, or fails at once when KPP_E2E_REQUIRE
// asks for the whole suite to run.
func runOrRefuse(m *testing.M, reason string) int {
	if testenv.Required() {
		fmt.Fprintf(os.Stderr, "e2e: %s, and %s is set\n", reason, testenv.EnvRequire)
		return 1
	}
	return m.Run()
}

// requireRoot skips t unless it can make namespaces and run the proxy.
func requireRoot(t *testing.T) {
	t.Helper()
	if noRoot != "" {
		t.Skipf("e2e skipped: %s", noRoot)
	}
}

// requireControlPlane skips t unless the shared control plane runs.
func requireControlPlane(t *testing.T) {
	t.Helper()
	requireRoot(t)
	if noControlPlane != "" {
		testenv.Unavailable(t, "e2e skipped: %s", noControlPlane)
	}
}

// findProxyBinary returns $KPP_BINARY, or builds the module's main package into dir.
func findProxyBinary(dir string) (string, error) {
	if p := os.Getenv(EnvBinary); p != "" {
		if !filepath.IsAbs(p) {
			p = filepath.Join("..", p)
		}
		abs, err := filepath.Abs(p)
		if err != nil {
			return "", err
		}
		if fi, err := os.Stat(abs); err != nil || fi.Mode().Perm()&0o111 == 0 {
			return "", fmt.Errorf("%s=%s is not an executable file", EnvBinary, p)
		}
		return abs, nil
	}
	out := filepath.Join(dir, "kube-portal-proxy")
	cmd := exec.Command("go", "build", "-o", out, "github.com/kube-portal-proxy/kube-portal-proxy")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the proxy (or set %s): %w: %s", EnvBinary, err, strings.TrimSpace(string(msg)))
	}
	return out, nil
}

// EnvIOEngine names the --io-engine the suite's proxies run on (make e2e-epoll sets it to epoll);
// unset means the default, auto (proxyArgs).
const EnvIOEngine = "KPP_E2E_IO_ENGINE"

// wantIOEngine is the engine the suite's proxies must serve on: the one named by EnvIOEngine,
// else io_uring where this kernel allows it, and always io_uring with KPP_E2E_REQUIRE=1 (the
// machines that run the suite have it: a pass on epoll instead would test the wrong engine).
func wantIOEngine(t *testing.T) string {
	t.Helper()
	switch e := os.Getenv(EnvIOEngine); e {
	case "", tcp.EngineAuto:
		if err := tcp.ProbeIOUring(); err != nil {
			if testenv.Required() {
				t.Fatalf("io_uring unavailable, so the suite would run on epoll: %v, and %s is set", err, testenv.EnvRequire)
			}
			t.Logf("io_uring unavailable here, so the default is epoll: %v", err)
			return tcp.EngineEpoll
		}
		return tcp.EngineIOUring
	default:
		return e
	}
}

// TestIOEngineAsAsked: both passes of the suite (make test on the default engine, make e2e-epoll
// on epoll) would pass silently on epoll if io_uring failed in the proxy, at the probe or after
// it (tcp/fallback.go). A proxy with the suite's flags serving one service must name the engine
// asked for as the one serving, with no engine failure counted.
func TestIOEngineAsAsked(t *testing.T) {
	t.Parallel()
	want := wantIOEngine(t)
	bed := newBed(t, 1)
	dir, write := servicesDir(t)
	write(webManifest(externalIP(), 1))
	proxy := startProxy(t, bed.Node, t.TempDir(), proxyArgs("--services-file="+dir)...)
	// The io_uring engine starts with the first proxy socket: a served connection proves it did.
	proxy.waitAnswers(t, bed.Client, netip.AddrPortFrom(fileWebIP, 80), "the service answers")
	for _, tt := range []struct {
		series string
		want   float64
	}{
		{fmt.Sprintf("kube_portal_proxy_io_engine{engine=%q}", want), 1},
		{`kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="start"}`, 0},
		{`kube_portal_proxy_io_engine_failures_total{engine="io_uring",phase="run"}`, 0},
	} {
		if want != tcp.EngineIOUring && strings.Contains(tt.series, "failures") {
			continue // only an io_uring engine fails over
		}
		got, err := scrape(bed.Node, tt.series)
		if err != nil || got != tt.want {
			// The proxy's log follows (startProxy's cleanup): it says why, at start.
			t.Fatalf("%s = %v (%v), want %v: %s=%q asks for %s", tt.series, got, err, tt.want, EnvIOEngine, os.Getenv(EnvIOEngine), want)
		}
	}
}
