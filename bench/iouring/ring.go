// Package iouring is an experiment (issue 20, not product code): a minimal TCP forwarder on
// io_uring, to measure whether completion-based I/O (multishot accept, connect, recv/send,
// shutdown and close submitted in batches, one ring per thread, no readiness round trip) closes
// the gap to nginx and HAProxy on new connections and keep-alive requests. bench/tcp runs it as
// the target "iouring" (role iouring); bench/suite can run it with
// -compare "/path/to/benchtcp -role iouring".
//
// The ring is set up with raw io_uring_setup/io_uring_enter and mmap (golang.org/x/sys/unix):
// the Go io_uring libraries named in the issue are not served by this machine's module proxy.
package iouring

import (
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Kernel ABI (include/uapi/linux/io_uring.h).
const (
	opConnectK = 16
	opCloseK   = 19
	opSendK    = 26
	opRecvK    = 27
	opAcceptK  = 13

	acceptMultishot = 1 << 0 // sqe.ioprio for IORING_OP_ACCEPT

	cqeFMore = 1 << 1 // IORING_CQE_F_MORE: a multishot request stays armed

	setupSingleIssuer = 1 << 12
	setupDeferTaskrun = 1 << 13
	setupCoopTaskrun  = 1 << 8

	featSingleMmap = 1 << 0

	enterGetEvents = 1 << 0

	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000
)

type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

// sqe is struct io_uring_sqe (64 bytes).
type sqe struct {
	opcode      uint8
	flags       uint8
	ioprio      uint16
	fd          int32
	off         uint64
	addr        uint64
	len         uint32
	opFlags     uint32
	userData    uint64
	bufIndex    uint16
	personality uint16
	spliceFdIn  int32
	addr3       uint64
	pad         uint64
}

// cqe is struct io_uring_cqe without CQE32.
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

// ring is one io_uring instance, used by one OS thread only (IORING_SETUP_SINGLE_ISSUER).
type ring struct {
	fd int

	sqHead, sqTail *uint32
	sqMask         uint32
	sqEntries      uint32
	sqes           []sqe
	tail           uint32 // next SQE to fill; published to *sqTail by flush
	toSubmit       uint32

	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []cqe

	mem, sqeMem []byte
}

func newRing(entries uint32) (*ring, error) {
	var p params
	p.flags = setupSingleIssuer | setupDeferTaskrun
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno == unix.EINVAL { // an older kernel: no DEFER_TASKRUN
		p = params{flags: setupCoopTaskrun}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	}
	if errno != 0 {
		return nil, os.NewSyscallError("io_uring_setup", errno)
	}
	r := &ring{fd: int(fd)}
	if p.features&featSingleMmap == 0 {
		unix.Close(r.fd)
		return nil, fmt.Errorf("io_uring: kernel without IORING_FEAT_SINGLE_MMAP")
	}
	size := max(int(p.sqOff.array)+int(p.sqEntries)*4, int(p.cqOff.cqes)+int(p.cqEntries)*int(unsafe.Sizeof(cqe{})))
	mem, err := unix.Mmap(r.fd, offSQRing, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		unix.Close(r.fd)
		return nil, os.NewSyscallError("mmap rings", err)
	}
	sqeMem, err := unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*int(unsafe.Sizeof(sqe{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		unix.Munmap(mem)
		unix.Close(r.fd)
		return nil, os.NewSyscallError("mmap sqes", err)
	}
	r.mem, r.sqeMem = mem, sqeMem
	base := unsafe.Pointer(&mem[0])
	at := func(off uint32) *uint32 { return (*uint32)(unsafe.Add(base, off)) }
	r.sqHead, r.sqTail = at(p.sqOff.head), at(p.sqOff.tail)
	r.sqMask, r.sqEntries = *at(p.sqOff.ringMask), *at(p.sqOff.ringEntries)
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&sqeMem[0])), p.sqEntries)
	// Identity map of the SQ index array: SQE i is submitted from slot i.
	array := unsafe.Slice(at(p.sqOff.array), p.sqEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	r.cqHead, r.cqTail = at(p.cqOff.head), at(p.cqOff.tail)
	r.cqMask = *at(p.cqOff.ringMask)
	r.cqes = unsafe.Slice((*cqe)(unsafe.Add(base, p.cqOff.cqes)), p.cqEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	return r, nil
}

// get returns a zeroed SQE to fill, submitting what is queued first if the ring is full.
func (r *ring) get() *sqe {
	for r.tail-atomic.LoadUint32(r.sqHead) >= r.sqEntries {
		r.enter(0)
	}
	s := &r.sqes[r.tail&r.sqMask]
	*s = sqe{}
	r.tail++
	r.toSubmit++
	return s
}

// enter publishes the queued SQEs and submits them, waiting for at least wait completions, in one
// system call. It blocks in the kernel, so it goes through Syscall (the P can be handed off).
//
// Tried: RawSyscall, keeping the P as tcp/sys.go does for calls that never block, to spare
// sysmon's 20 µs polling of Ps in system calls (8% of the samples). The process wedged at its
// first garbage collection: a loop waiting in the kernel never reaches a safe point, so the
// stop-the-world never completes.
func (r *ring) enter(wait uint32) {
	atomic.StoreUint32(r.sqTail, r.tail)
	for {
		n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.toSubmit), uintptr(wait), enterGetEvents, 0, 0)
		switch errno {
		case 0:
			r.toSubmit -= uint32(n)
			return
		case unix.EINTR:
			continue
		case unix.EAGAIN, unix.EBUSY: // CQ overflow backlog: reap, then submit again
			return
		default:
			panic(fmt.Sprintf("io_uring_enter: %v", errno))
		}
	}
}

// reap calls f for every completion available and returns how many there were.
func (r *ring) reap(f func(*cqe)) int {
	head := *r.cqHead
	tail := atomic.LoadUint32(r.cqTail)
	n := 0
	for ; head != tail; head++ {
		c := r.cqes[head&r.cqMask] // copied: f may queue SQEs and the slot may be reused after advance
		atomic.StoreUint32(r.cqHead, head+1)
		f(&c)
		n++
	}
	return n
}

func (r *ring) close() {
	unix.Munmap(r.sqeMem)
	unix.Munmap(r.mem)
	unix.Close(r.fd)
}
