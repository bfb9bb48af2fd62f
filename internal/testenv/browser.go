package testenv

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
)

// Chromium returns the path of the headless browser the status page tests need; missing, the
// test is unavailable (a failure under KPP_E2E_REQUIRE).
func Chromium(t testing.TB) string {
	t.Helper()
	browser, err := exec.LookPath("chromium")
	if err != nil {
		Unavailable(t, "chromium not installed (apt-get install chromium); the status page test needs a real browser")
	}
	return browser
}

// RenderedDOM loads url in headless Chromium and returns the DOM once the page's script has run.
func RenderedDOM(t testing.TB, browser, url string) string {
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
