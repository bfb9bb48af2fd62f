// Package wait holds what the tests of several packages share: polling a condition with a
// deadline, instead of sleeping for a guessed time.
package wait

import (
	"testing"
	"time"
)

// Timeout bounds every For. It only matters when a test fails, so it is generous for a
// loaded 2-core machine running tests with -race.
const Timeout = 10 * time.Second

// For polls cond until it holds and fails the test, naming what it waited for, if it does
// not hold within Timeout.
func For(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", Timeout, what)
		}
		time.Sleep(2 * time.Millisecond) // polling a condition with a deadline
	}
}
