package udp

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// A loop opens its sessions' backend sockets, and a socket belongs to the network namespace of
// the thread that creates it. Run serves its first shard on the caller's goroutine and the others
// on goroutines of their own, whose threads are in the process's namespace; a caller that runs a
// proxy inside another namespace (a locked thread that entered it, as the netns tests and
// internal/netns.NS.Do do) must get every loop's sockets there too. So each extra loop compares
// its thread's namespace with the caller's and, if they differ, locks its thread and enters the
// caller's. The thread is never unlocked: the runtime ends it with the goroutine, so no other
// goroutine runs in that namespace. In the daemon the namespaces are the same and nothing is
// locked (a locked loop would hold its thread while parked).

// callerNetns opens the network namespace of the calling thread. The caller must hold its thread
// (locked, or not yet switched) until it has called this.
func callerNetns() (*os.File, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()))
	if err != nil {
		return nil, fmt.Errorf("open the caller's network namespace: %w", err)
	}
	return f, nil
}

// enterNetns puts the calling goroutine in the namespace ns if its thread is elsewhere. It must
// run first on the goroutine of a loop, which then must not unlock its thread.
func enterNetns(ns *os.File) error {
	var want unix.Stat_t
	if err := unix.Fstat(int(ns.Fd()), &want); err != nil {
		return os.NewSyscallError("fstat network namespace", err)
	}
	runtime.LockOSThread()
	var cur unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()), &cur); err != nil {
		return os.NewSyscallError("stat network namespace", err) // stays locked: the thread is suspect
	}
	if cur.Dev == want.Dev && cur.Ino == want.Ino {
		runtime.UnlockOSThread()
		return nil
	}
	return os.NewSyscallError("setns", unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET))
}
