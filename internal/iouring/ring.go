// Package iouring is the io_uring plumbing of the TCP proxy's io_uring engine (package tcp): a
// ring set up with raw io_uring_setup/io_uring_enter and mmap through golang.org/x/sys/unix, a
// provided-buffer ring, and Probe, which tells whether this kernel (and the sandbox around the
// process: seccomp, kernel.io_uring_disabled) lets the engine run. It knows nothing of proxies.
//
// A Ring is used by one OS thread only (IORING_SETUP_SINGLE_ISSUER): the caller locks the thread.
package iouring

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Opcodes (include/uapi/linux/io_uring.h, enum io_uring_op).
const (
	OpNop         = 0
	OpPollAdd     = 6
	OpTimeout     = 11
	OpAccept      = 13
	OpAsyncCancel = 14
	OpLinkTimeout = 15
	OpConnect     = 16
	OpClose       = 19
	OpRead        = 22
	OpSend        = 26
	OpRecv        = 27
	OpURingCmd    = 46
)

// socketSetsockopt is SOCKET_URING_OP_SETSOCKOPT, the cmd_op of an OpURingCmd on a socket (6.7).
const socketSetsockopt = 3

// SQE flags (IOSQE_*).
const (
	SqeIOLink         = 1 << 2
	SqeBufferSelect   = 1 << 5
	SqeCQESkipSuccess = 1 << 6 // post a completion only if the request fails
)

// Operation flags.
const (
	AcceptMultishot = 1 << 0 // sqe.ioprio of OpAccept (IORING_ACCEPT_MULTISHOT)
	CancelAll       = 1 << 0 // sqe.opFlags of OpAsyncCancel (IORING_ASYNC_CANCEL_ALL)
	CancelFD        = 1 << 1 // IORING_ASYNC_CANCEL_FD: every request on sqe.fd
	PollAddMulti    = 1 << 0 // sqe.len of OpPollAdd (IORING_POLL_ADD_MULTI): a multishot, edge-triggered poll
)

// CQE flags.
const (
	CqeFBuffer = 1 << 0 // IORING_CQE_F_BUFFER: flags>>16 is the provided buffer's id
	CqeFMore   = 1 << 1 // IORING_CQE_F_MORE: a multishot request stays armed
)

const (
	setupCoopTaskrun  = 1 << 8
	setupSingleIssuer = 1 << 12
	setupDeferTaskrun = 1 << 13

	featSingleMmap = 1 << 0

	enterGetEvents = 1 << 0

	offSQRing = 0
	offSQEs   = 0x10000000

	registerProbe     = 8
	registerPbufRing  = 22
	unregisterPbuf    = 23
	probeOpSupported  = 1 << 0
	pbufRingEntrySize = 16
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

// SQE is struct io_uring_sqe (64 bytes). Fields are named after the kernel's; unions carry the
// name of the member this package uses.
type SQE struct {
	Opcode   uint8
	Flags    uint8
	Ioprio   uint16
	Fd       int32
	Off      uint64
	Addr     uint64
	Len      uint32
	OpFlags  uint32 // msg_flags, poll32_events, timeout_flags, cancel_flags, accept_flags...
	UserData uint64
	BufGroup uint16 // buf_index / buf_group
	_        uint16 // personality
	Optlen   uint32 // splice_fd_in / file_index / optlen
	Addr3    uint64 // addr3 / optval
	_        uint64
}

// Setsockopt makes s the socket command setsockopt(fd, level, opt, val, 4) (IORING_OP_URING_CMD,
// SOCKET_URING_OP_SETSOCKOPT; see Ring.SocketCommands). The kernel reads *val when it takes the
// SQE, at the next Enter: val must stay put until then.
func (s *SQE) Setsockopt(fd int32, level, opt uint32, val *int32) {
	s.Opcode, s.Fd = OpURingCmd, fd
	s.Off = socketSetsockopt // cmd_op, the low half of off
	s.Addr = uint64(level) | uint64(opt)<<32
	s.Optlen, s.Addr3 = 4, uint64(uintptr(unsafe.Pointer(val)))
}

// SocketCommands reports whether this kernel runs setsockopt as a ring request (6.7), by setting
// TCP_NODELAY on a throwaway socket. Call it on a ring with nothing else in flight (at setup).
func (r *Ring) SocketCommands() bool {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	one := int32(1)
	s := r.Get()
	s.Setsockopt(int32(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, &one)
	if err := r.Enter(1); err != nil {
		return false
	}
	var res int32 = -1
	r.Reap(func(c *CQE) { res = c.Res })
	if res != 0 {
		return false
	}
	v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY)
	return err == nil && v == 1
}

// CQE is struct io_uring_cqe (without IORING_SETUP_CQE32).
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// Ring is one io_uring instance.
type Ring struct {
	fd int

	sqHead, sqTail *uint32
	sqMask         uint32
	sqEntries      uint32
	sqes           []SQE
	tail           uint32 // next SQE to fill; published to *sqTail by Enter
	toSubmit       uint32

	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           []CQE
	// cur is the completion Reap hands to its callback: a copy in the ring, because a copy on
	// Reap's stack escapes to the heap through the callback (an allocation per completion).
	cur CQE

	mem, sqeMem []byte
}

// New sets up a ring of entries submission slots (a power of two) and twice as many completion
// slots. It asks for SINGLE_ISSUER|DEFER_TASKRUN (6.1): completions are processed only when the
// owning thread enters the kernel to wait for them, never by interrupting it. On an older kernel
// it falls back to COOP_TASKRUN.
func New(entries uint32) (*Ring, error) {
	var p params
	p.flags = setupSingleIssuer | setupDeferTaskrun
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno == unix.EINVAL {
		p = params{flags: setupCoopTaskrun}
		fd, _, errno = unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	}
	if errno != 0 {
		return nil, os.NewSyscallError("io_uring_setup", errno)
	}
	r := &Ring{fd: int(fd)}
	if p.features&featSingleMmap == 0 {
		unix.Close(r.fd)
		return nil, errors.New("io_uring: kernel without IORING_FEAT_SINGLE_MMAP (older than 5.4)")
	}
	size := max(int(p.sqOff.array)+int(p.sqEntries)*4, int(p.cqOff.cqes)+int(p.cqEntries)*int(unsafe.Sizeof(CQE{})))
	mem, err := unix.Mmap(r.fd, offSQRing, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		unix.Close(r.fd)
		return nil, os.NewSyscallError("mmap io_uring rings", err)
	}
	sqeMem, err := unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*int(unsafe.Sizeof(SQE{})), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		unix.Munmap(mem)
		unix.Close(r.fd)
		return nil, os.NewSyscallError("mmap io_uring sqes", err)
	}
	r.mem, r.sqeMem = mem, sqeMem
	base := unsafe.Pointer(&mem[0])
	at := func(off uint32) *uint32 { return (*uint32)(unsafe.Add(base, off)) }
	r.sqHead, r.sqTail = at(p.sqOff.head), at(p.sqOff.tail)
	r.sqMask, r.sqEntries = *at(p.sqOff.ringMask), *at(p.sqOff.ringEntries)
	r.sqes = unsafe.Slice((*SQE)(unsafe.Pointer(&sqeMem[0])), p.sqEntries)
	// Identity map of the SQ index array: SQE i is submitted from slot i.
	array := unsafe.Slice(at(p.sqOff.array), p.sqEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	r.cqHead, r.cqTail = at(p.cqOff.head), at(p.cqOff.tail)
	r.cqMask = *at(p.cqOff.ringMask)
	r.cqes = unsafe.Slice((*CQE)(unsafe.Add(base, p.cqOff.cqes)), p.cqEntries)
	r.tail = atomic.LoadUint32(r.sqTail)
	return r, nil
}

// Get returns a zeroed SQE to fill; it submits what is queued first if the ring is full. The SQE
// goes to the kernel at the next Enter.
func (r *Ring) Get() *SQE {
	for r.tail-atomic.LoadUint32(r.sqHead) >= r.sqEntries {
		if err := r.Enter(0); err != nil {
			break // the slot is reused: Enter failing here means the ring is unusable anyway
		}
	}
	s := &r.sqes[r.tail&r.sqMask]
	*s = SQE{}
	r.tail++
	r.toSubmit++
	return s
}

// Pending reports whether SQEs wait for the next Enter.
func (r *Ring) Pending() bool { return r.toSubmit > 0 }

// Enter submits the queued SQEs and, if wait > 0, waits for that many completions, in one system
// call. Waiting blocks in the kernel, so it goes through Syscall: the goroutine's P is handed to
// another thread if the wait lasts (RawSyscall would keep it, and the process wedged at its first
// garbage collection: a thread waiting in the kernel never reaches a safe point).
func (r *Ring) Enter(wait uint32) error {
	atomic.StoreUint32(r.sqTail, r.tail)
	for {
		var n uintptr
		var errno unix.Errno
		if wait == 0 {
			// Submission only: never blocks, so the P stays with the thread.
			n, _, errno = unix.RawSyscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.toSubmit), 0, enterGetEvents, 0, 0)
		} else {
			n, _, errno = unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(r.toSubmit), uintptr(wait), enterGetEvents, 0, 0)
		}
		switch errno {
		case 0:
			r.toSubmit -= uint32(n)
			return nil
		case unix.EINTR:
			continue
		case unix.EAGAIN, unix.EBUSY: // completion backlog: the caller reaps, then submits again
			return nil
		default:
			return os.NewSyscallError("io_uring_enter", errno)
		}
	}
}

// Reap calls f for every completion available and returns how many there were. f may call Get,
// not Reap; the *CQE is valid until f returns.
func (r *Ring) Reap(f func(*CQE)) int {
	head := *r.cqHead
	n := 0
	for tail := atomic.LoadUint32(r.cqTail); head != tail; tail = atomic.LoadUint32(r.cqTail) {
		for ; head != tail; head++ {
			r.cur = r.cqes[head&r.cqMask] // a copy: the slot is the kernel's again once head moves
			atomic.StoreUint32(r.cqHead, head+1)
			f(&r.cur)
			n++
		}
	}
	return n
}

// Close releases the ring; requests still in flight are cancelled by the kernel.
func (r *Ring) Close() error {
	unix.Munmap(r.sqeMem)
	unix.Munmap(r.mem)
	return unix.Close(r.fd)
}

func (r *Ring) register(op uintptr, arg unsafe.Pointer, n uintptr) error {
	_, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(r.fd), op, uintptr(arg), n, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// probeOps is struct io_uring_probe with room for every opcode.
type probeOps struct {
	lastOp, opsLen uint8
	_              uint16
	_              [3]uint32
	ops            [256]struct {
		op, _ uint8
		flags uint16
		_     uint32
	}
}

// Supports reports which of ops this ring's kernel implements (IORING_REGISTER_PROBE, 5.6); the
// first missing one is returned, -1 if none is.
func (r *Ring) Supports(ops ...uint8) (missing int, err error) {
	var p probeOps
	if err := r.register(registerProbe, unsafe.Pointer(&p), uintptr(len(p.ops))); err != nil {
		return -1, fmt.Errorf("io_uring_register(IORING_REGISTER_PROBE): %w", err)
	}
	for _, op := range ops {
		if op > p.lastOp || p.ops[op].flags&probeOpSupported == 0 {
			return int(op), nil
		}
	}
	return -1, nil
}

// BufRing is a provided-buffer ring (IORING_REGISTER_PBUF_RING, 5.19): n buffers of size bytes
// that the kernel takes one at a time for requests with SqeBufferSelect in group bgid, so a
// request waiting for data holds no buffer. Buffers live outside the Go heap (mmap), so the kernel
// may write them whatever the garbage collector does; their pages are touched only once used.
type BufRing struct {
	r        *Ring
	bgid     uint16
	entries  []byte // n * 16 bytes of struct io_uring_buf; the ring's tail overlaps the first
	mem      []byte
	mask     uint16
	tail     uint16
	Size     int
	released int
}

// NewBufRing registers a buffer ring of n (a power of two) buffers of size bytes as group bgid,
// every buffer given to the kernel.
func (r *Ring) NewBufRing(bgid uint16, n, size int) (*BufRing, error) {
	if n <= 0 || n&(n-1) != 0 || n > 1<<15 {
		return nil, fmt.Errorf("buffer ring of %d entries: want a power of two up to 32768", n)
	}
	entries, err := unix.Mmap(-1, 0, n*pbufRingEntrySize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE)
	if err != nil {
		return nil, os.NewSyscallError("mmap buffer ring", err)
	}
	mem, err := unix.Mmap(-1, 0, n*size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE)
	if err != nil {
		unix.Munmap(entries)
		return nil, os.NewSyscallError("mmap buffers", err)
	}
	reg := bufRingReg{ringAddr: uint64(uintptr(unsafe.Pointer(&entries[0]))), ringEntries: uint32(n), bgid: bgid}
	if err := r.register(registerPbufRing, unsafe.Pointer(&reg), 1); err != nil {
		unix.Munmap(mem)
		unix.Munmap(entries)
		return nil, fmt.Errorf("io_uring_register(IORING_REGISTER_PBUF_RING): %w", err)
	}
	b := &BufRing{r: r, bgid: bgid, entries: entries, mem: mem, mask: uint16(n - 1), Size: size}
	for i := range n {
		b.put(uint16(i))
	}
	b.publish()
	return b, nil
}

// Group is the buffer group id, for SQE.BufGroup.
func (b *BufRing) Group() uint16 { return b.bgid }

// Buf returns buffer id's memory.
func (b *BufRing) Buf(id uint16) []byte {
	off := int(id) * b.Size
	return b.mem[off : off+b.Size : off+b.Size]
}

// Release gives buffer id back to the kernel.
func (b *BufRing) Release(id uint16) {
	b.put(id)
	b.publish()
}

func (b *BufRing) put(id uint16) {
	e := unsafe.Pointer(&b.entries[int(b.tail&b.mask)*pbufRingEntrySize])
	*(*uint64)(e) = uint64(uintptr(unsafe.Pointer(&b.mem[int(id)*b.Size])))
	*(*uint32)(unsafe.Add(e, 8)) = uint32(b.Size)
	*(*uint16)(unsafe.Add(e, 12)) = id
	b.tail++
}

// publish stores the tail where the kernel reads it: the resv field of the first entry.
func (b *BufRing) publish() {
	tail := (*uint32)(unsafe.Pointer(&b.entries[12])) // u16 at 14, in the upper half of this word
	for {
		old := atomic.LoadUint32(tail)
		nw := old&0xffff | uint32(b.tail)<<16
		if atomic.CompareAndSwapUint32(tail, old, nw) {
			return
		}
	}
}

// bufRingReg is struct io_uring_buf_reg, the argument of IORING_(UN)REGISTER_PBUF_RING.
type bufRingReg struct {
	ringAddr    uint64
	ringEntries uint32
	bgid        uint16
	flags       uint16
	_           [3]uint64
}

// Close unregisters the buffer ring and frees its memory. Requests that may still select a
// buffer must be finished first.
func (b *BufRing) Close() {
	reg := bufRingReg{bgid: b.bgid}
	_ = b.r.register(unregisterPbuf, unsafe.Pointer(&reg), 1)
	unix.Munmap(b.mem)
	unix.Munmap(b.entries)
}
