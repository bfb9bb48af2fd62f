package tcp

import "testing"

// TestSignal: a signal's channel is closed by fire whether it was made before (a waiter) or after
// (a late waiter), fired says so, and renew fires the waiters of the old one and leaves one that
// has not fired.
func TestSignal(t *testing.T) {
	closed := func(c <-chan struct{}) bool {
		select {
		case <-c:
			return true
		default:
			return false
		}
	}
	var early signal
	c := early.wait()
	if closed(c) || early.fired() {
		t.Fatal("fired before fire")
	}
	early.fire()
	if !closed(c) || !early.fired() || !closed(early.wait()) {
		t.Fatal("a channel made before fire is not closed by it")
	}

	var late signal
	late.fire()
	if !late.fired() || !closed(late.wait()) {
		t.Fatal("a channel asked for after fire is not closed")
	}

	var changed signal
	old := changed.wait()
	changed.renew()
	if !closed(old) {
		t.Fatal("renew did not close the old channel")
	}
	if changed.fired() || closed(changed.wait()) {
		t.Fatal("the renewed signal has fired")
	}
	changed.renew() // a renewed signal fires again
	if !closed(old) {
		t.Fatal("unreachable")
	}
}
