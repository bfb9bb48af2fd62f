// Package testenv holds what the tests of several packages share: polling a condition with a
// deadline instead of sleeping for a guessed time, skipping a test the machine cannot run (or
// failing it when KPP_E2E_REQUIRE says everything must run), loopback echo servers, a headless
// browser for the status page, and small constructors of test values.
package testenv

import (
	"fmt"
	"os"
	"testing"
	"time"
)

// WaitTimeout bounds every WaitFor. It only matters when a test fails, so it is generous for a
// loaded 2-core machine running tests with -race.
const WaitTimeout = 10 * time.Second

// WaitFor polls cond until it holds and fails the test, naming what it waited for, if it does not
// hold within WaitTimeout.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	WaitForEvery(t, WaitTimeout, 2*time.Millisecond, what, cond)
}

// WaitForEvery is WaitFor with the caller's deadline and polling interval: a promise with a
// bound of its own (a repair within one sync period) waits no longer than that bound, and a
// condition that costs a process (iptables-save) is not asked every 2 ms.
func WaitForEvery(t testing.TB, timeout, every time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(every) // polling a condition with a deadline
	}
}

// EnvRequire names the variable that turns skips for a missing capability (root, IPv6, a tool)
// into failures: set to anything but "" or "0", every test must run. CI sets it; e2e/framework
// reads the same variable.
const EnvRequire = "KPP_E2E_REQUIRE"

// Required reports whether EnvRequire is set.
func Required() bool {
	v := os.Getenv(EnvRequire)
	return v != "" && v != "0"
}

// Unavailable ends a test that this machine cannot run: it skips, or fails when Required().
func Unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if Required() {
		t.Fatalf("%s, and %s is set", msg, EnvRequire)
		return
	}
	t.Skipf("%s (set %s=1 to fail instead)", msg, EnvRequire)
}
