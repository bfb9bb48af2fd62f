package iouring

import (
	"runtime"
	"sync"
	"testing"
)

// TestProbeOnAnyThread: Probe sets a ring up SINGLE_ISSUER, which binds it to the OS thread that
// made it; every later io_uring_register on another thread fails with EEXIST. A goroutine moves
// between threads at any syscall, so Probe must keep its thread for the ring's life: run from
// unlocked goroutines on a busy scheduler, it failed ("io_uring_register(IORING_REGISTER_PROBE):
// file exists") in a daemon start and a test under load before it did.
func TestProbeOnAnyThread(t *testing.T) {
	requireIOURing(t)
	const goroutines, probes = 16, 50
	stop := make(chan struct{})
	var busy sync.WaitGroup
	for range runtime.GOMAXPROCS(0) * 2 { // keep every P busy so a blocked probe loses its thread
		busy.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					runtime.Gosched()
				}
			}
		})
	}
	defer func() { close(stop); busy.Wait() }()
	errs := make(chan error, goroutines)
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range probes {
				if err := Probe(); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	n := 0
	for err := range errs {
		if n == 0 {
			t.Errorf("Probe: %v", err)
		}
		n++
	}
	if n > 0 {
		t.Errorf("%d of %d goroutines saw Probe fail", n, goroutines)
	}
}
