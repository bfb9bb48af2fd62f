package proxier

// restartparallel.go: the reopen's sockets opened by several threads at once. At 10,000 service
// ports the reopen is the whole of a restart's gap for most ports (socket, options, bind, listen
// and the engine's arm per port, 25 us each on an idle CPU); on a node whose CPUs are all busy one
// thread gets a small share of one CPU and took 1.4-3.5 s. A socket belongs to the network
// namespace of the thread that creates it, and Go starts goroutines on any thread: a worker that
// finds its thread in another namespace than the caller's (the caller was switched into one, as
// tests run the proxier) enters the caller's namespace, and its thread is thrown away after.

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// maxReopenWorkers bounds the threads of a reopen: beyond the CPUs they only queue.
const maxReopenWorkers = 8

// reopenWorkers is how many threads open sockets at once: one per CPU the runtime uses, and at
// least two (a node of one CPU still gets a second share of it when other processes compete).
func reopenWorkers() int { return min(max(runtime.GOMAXPROCS(0), 2), maxReopenWorkers) }

// forEachInNetns calls work(i) for every i in [0, n), on the calling goroutine and on up to
// workers-1 more threads, each in the network namespace of the calling thread. It returns once
// every call has returned. A worker that cannot enter the namespace does nothing: the others,
// the caller among them, take its share.
func forEachInNetns(n, workers int, work func(i int)) {
	var next atomic.Int64
	drain := func() {
		for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
			work(i)
		}
	}
	if workers <= 1 || n <= 1 {
		drain()
		return
	}
	// The caller's thread is its namespace: keep the goroutine on it while workers read it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ns, err := os.Open(threadNetnsPath())
	if err != nil {
		drain() // no way to tell the workers which namespace: open them all here
		return
	}
	defer ns.Close()
	want, err := netnsID(int(ns.Fd()))
	if err != nil {
		drain()
		return
	}
	var wg sync.WaitGroup
	for range min(workers, n) - 1 {
		wg.Go(func() {
			runtime.LockOSThread()
			switched, err := enterNetns(int(ns.Fd()), want)
			if err != nil {
				// Locked and maybe half-switched: the goroutine ends with the thread locked, so the
				// runtime discards the thread instead of reusing it.
				return
			}
			drain()
			if !switched {
				runtime.UnlockOSThread()
			} // else: the thread stays locked and dies with the goroutine, as above.
		})
	}
	drain()
	wg.Wait()
}

func threadNetnsPath() string {
	return fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
}

// nsID identifies a namespace: the device and inode of its nsfs file.
type nsID struct{ dev, ino uint64 }

func netnsID(fd int) (nsID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nsID{}, fmt.Errorf("stat network namespace: %w", err)
	}
	return nsID{dev: st.Dev, ino: st.Ino}, nil
}

// enterNetns switches the calling (locked) thread into the namespace of fd unless it is in it
// already (want), reporting whether it switched.
func enterNetns(fd int, want nsID) (switched bool, err error) {
	var st unix.Stat_t
	if err := unix.Stat(threadNetnsPath(), &st); err != nil {
		return false, fmt.Errorf("stat this thread's network namespace: %w", err)
	}
	if (nsID{dev: st.Dev, ino: st.Ino}) == want {
		return false, nil
	}
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		return true, fmt.Errorf("enter the caller's network namespace: %w", err)
	}
	return true, nil
}
