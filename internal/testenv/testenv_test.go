package testenv

import (
	"sync/atomic"
	"testing"
)

func TestWaitForReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	WaitFor(t, "the third call", func() bool { return calls.Add(1) == 3 })
	if n := calls.Load(); n != 3 {
		t.Errorf("cond called %d times, want 3 (polling stops once it holds)", n)
	}
}

func TestRequired(t *testing.T) {
	for _, tt := range []struct {
		value string
		want  bool
	}{{"", false}, {"0", false}, {"1", true}, {"yes", true}} {
		t.Setenv(EnvRequire, tt.value)
		if got := Required(); got != tt.want {
			t.Errorf("Required() with %s=%q = %v, want %v", EnvRequire, tt.value, got, tt.want)
		}
	}
}

// recorder is a testing.TB that records how a test ended instead of ending it.
type recorder struct {
	testing.TB
	ended string
}

func (r *recorder) Helper()               {}
func (r *recorder) Fatalf(string, ...any) { r.ended = "fail" }
func (r *recorder) Skipf(string, ...any)  { r.ended = "skip" }

func TestUnavailableSkipsOrFailsWhenRequired(t *testing.T) {
	for _, tt := range []struct {
		require, want string
	}{{"", "skip"}, {"0", "skip"}, {"1", "fail"}} {
		t.Setenv(EnvRequire, tt.require)
		r := &recorder{}
		Unavailable(r, "no %s here", "IPv6")
		if r.ended != tt.want {
			t.Errorf("Unavailable with %s=%q: the test would %s, want %s", EnvRequire, tt.require, r.ended, tt.want)
		}
	}
}
