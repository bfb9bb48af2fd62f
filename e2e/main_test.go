package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
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
