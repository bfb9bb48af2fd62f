package tcp

import "sync/atomic"

// signal is a channel that is closed once, made at its first wait: a listening proxy that
// nobody waits on (most of 10,000 service ports on the io_uring engine) holds 8 bytes for it
// instead of a 96-byte channel. The zero value is ready.
type signal struct{ ch atomic.Pointer[chan struct{}] }

// closedChan stands in for the channel of a signal fired before anyone waited.
var closedChan = func() *chan struct{} {
	c := make(chan struct{})
	close(c)
	return &c
}()

// wait returns the channel that fire closes.
func (s *signal) wait() <-chan struct{} {
	if c := s.ch.Load(); c != nil {
		return *c
	}
	c := make(chan struct{})
	if s.ch.CompareAndSwap(nil, &c) {
		return c
	}
	return *s.ch.Load()
}

// fire closes the channel. Like close, it may be called once (callers hold a sync.Once or a lock).
func (s *signal) fire() {
	if s.ch.CompareAndSwap(nil, closedChan) {
		return
	}
	close(*s.ch.Load())
}

// fired reports whether fire was called.
func (s *signal) fired() bool {
	c := s.ch.Load()
	if c == nil {
		return false
	}
	select {
	case <-*c:
		return true
	default:
		return false
	}
}

// renew fires the signal and leaves a fresh one in its place, for a signal that says "changed"
// (lnChanged). The caller holds the lock that guards every renew and wait of it.
func (s *signal) renew() {
	s.fire()
	s.ch.Store(nil)
}
