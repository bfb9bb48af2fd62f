package iouring

import (
	"fmt"
	"runtime"
)

// NeededOps are the opcodes the TCP engine submits.
var NeededOps = []uint8{OpNop, OpPollAdd, OpAccept, OpAsyncCancel, OpLinkTimeout, OpConnect, OpClose, OpSend, OpRecv}

var opNames = map[uint8]string{
	OpNop: "NOP", OpPollAdd: "POLL_ADD", OpTimeout: "TIMEOUT", OpAccept: "ACCEPT", OpAsyncCancel: "ASYNC_CANCEL",
	OpLinkTimeout: "LINK_TIMEOUT", OpConnect: "CONNECT", OpClose: "CLOSE", OpRead: "READ", OpSend: "SEND", OpRecv: "RECV",
}

// Probe tells whether the engine can run here, and if not, why: io_uring_setup refused (a kernel
// without io_uring, kernel.io_uring_disabled, a seccomp profile that blocks it: container runtimes'
// default profiles do), an opcode the engine needs missing, or no provided-buffer rings. Multishot
// accept came in the same release as provided-buffer rings (5.19), so registering one is its test.
// The ring is SINGLE_ISSUER, bound to the thread that sets it up: Probe keeps its goroutine on
// that thread until the ring is closed (elsewhere io_uring_register fails with EEXIST).
func Probe() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r, err := New(8)
	if err != nil {
		return err
	}
	defer r.Close()
	missing, err := r.Supports(NeededOps...)
	if err != nil {
		return err
	}
	if missing >= 0 {
		return fmt.Errorf("io_uring: the kernel lacks IORING_OP_%s", opNames[uint8(missing)])
	}
	b, err := r.NewBufRing(0, 1, 4096)
	if err != nil {
		return fmt.Errorf("io_uring: no provided-buffer rings (kernel older than 5.19): %w", err)
	}
	b.Close()
	return nil
}
