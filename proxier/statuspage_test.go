package proxier

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestStatusPageInChromium loads the status page in a real headless browser and checks that the
// page's script rendered a service that exists and a connection that is open.
func TestStatusPageInChromium(t *testing.T) {
	browser := chromium(t)
	e := newRealEnv(t)
	c := e.openEcho(t)
	defer c.Close()
	dom := renderedDOM(t, browser, e.srv.URL+"/")
	for _, want := range []string{
		"<code>ns/echo:tcp</code>",                    // the service row
		"<code>" + c.LocalAddr().String() + "</code>", // the open connection's client
		"<code>" + e.tcpEcho.String() + "</code>",     // and its endpoint
		`<span id="conn-count">1</span>`,
		"cluster traffic: " + e.tcpEcho.String() + " — policy=Cluster", // which endpoints and why
		"balancing: round-robin",                                       // the balancing policy
		e.tcpEcho.String() + " ready, 1 active",                        // and the endpoint's live flows
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %q; page:\n%s", want, dom)
		}
	}
	if !strings.Contains(dom, `<span id="error"></span>`) {
		t.Errorf("the page reported a refresh failure:\n%s", dom)
	}
}

// chromium returns the path of the headless browser the status page tests need; missing, the test
// is unavailable (a failure under KPP_E2E_REQUIRE).
func chromium(t *testing.T) string {
	t.Helper()
	browser, err := exec.LookPath("chromium")
	if err != nil {
		testenv.Unavailable(t, "chromium not installed (apt-get install chromium); the status page test needs a real browser")
	}
	return browser
}

// renderedDOM loads url in headless Chromium and returns the DOM once the page's script has run.
func renderedDOM(t *testing.T, browser, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
		"--user-data-dir="+t.TempDir(), "--virtual-time-budget=5000", "--dump-dom", url)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium: %v", err)
	}
	return string(out)
}
