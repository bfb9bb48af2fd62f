package wait

import (
	"sync/atomic"
	"testing"
)

func TestForReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	For(t, "the third call", func() bool { return calls.Add(1) == 3 })
	if n := calls.Load(); n != 3 {
		t.Errorf("cond called %d times, want 3 (polling stops once it holds)", n)
	}
}
