package iouring

import (
	"os"
	"runtime"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// These tests pin the kernel behaviour the TCP engine relies on, on a Unix socket pair (no
// network at all).

func requireIOURing(t *testing.T) {
	t.Helper()
	if err := Probe(); err != nil {
		if os.Getenv("KPP_E2E_REQUIRE") == "1" {
			t.Fatalf("io_uring unavailable: %v", err)
		}
		t.Skipf("io_uring unavailable: %v", err)
	}
}

func waitOne(t *testing.T, r *Ring) CQE {
	t.Helper()
	var got []CQE
	for len(got) == 0 {
		if err := r.Enter(1); err != nil {
			t.Fatal(err)
		}
		r.Reap(func(c *CQE) { got = append(got, *c) })
	}
	if len(got) != 1 {
		t.Fatalf("%d completions, want 1: %+v", len(got), got)
	}
	return got[0]
}

// TestSendWaitsOnAFullNonBlockingSocket: a send on an O_NONBLOCK socket whose buffer is full does
// not complete with EAGAIN; it waits in the kernel until the peer reads.
func TestSendWaitsOnAFullNonBlockingSocket(t *testing.T) {
	requireIOURing(t)
	runtime.LockOSThread() // the ring is SINGLE_ISSUER: set up, entered and registered on one thread
	defer runtime.UnlockOSThread()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	chunk := make([]byte, 64<<10)
	for {
		if _, err := unix.Write(fds[0], chunk); err == unix.EAGAIN {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	r, err := New(8)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	msg := []byte("after the backlog")
	s := r.Get()
	s.Opcode, s.Fd, s.OpFlags = OpSend, int32(fds[0]), unix.MSG_NOSIGNAL
	s.Addr, s.Len, s.UserData = uint64(uintptr(unsafe.Pointer(&msg[0]))), uint32(len(msg)), 7
	if err := r.Enter(0); err != nil {
		t.Fatal(err)
	}
	if n := r.Reap(func(c *CQE) { t.Errorf("send completed on a full socket: %+v", *c) }); n != 0 {
		return
	}
	buf := make([]byte, 1<<20)
	for { // drain the backlog: the send goes through
		if _, err := unix.Read(fds[1], buf); err == unix.EAGAIN {
			break
		}
	}
	if c := waitOne(t, r); c.UserData != 7 || c.Res != int32(len(msg)) {
		t.Errorf("completion %+v, want user data 7 and %d bytes sent", c, len(msg))
	}
}

// TestRecvSelectsARingBuffer: a recv with SqeBufferSelect takes a buffer only when data arrives,
// reports its id, and fails with ENOBUFS once the ring is empty.
func TestRecvSelectsARingBuffer(t *testing.T) {
	requireIOURing(t)
	runtime.LockOSThread() // the ring is SINGLE_ISSUER: set up, entered and registered on one thread
	defer runtime.UnlockOSThread()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	r, err := New(8)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b, err := r.NewBufRing(3, 1, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	recv := func() {
		s := r.Get()
		s.Opcode, s.Fd, s.Flags, s.BufGroup, s.Len = OpRecv, int32(fds[1]), SqeBufferSelect, b.Group(), 4096
		if err := r.Enter(0); err != nil {
			t.Fatal(err)
		}
	}
	recv()
	if n := r.Reap(func(c *CQE) { t.Errorf("recv completed without data: %+v", *c) }); n != 0 {
		return
	}
	unix.Write(fds[0], []byte("hello"))
	c := waitOne(t, r)
	if c.Res != 5 || c.Flags&CqeFBuffer == 0 || string(b.Buf(uint16(c.Flags >> 16))[:5]) != "hello" {
		t.Fatalf("completion %+v, want 5 bytes in a selected buffer", c)
	}
	unix.Write(fds[0], []byte("again"))
	recv() // the only buffer is still taken
	if c := waitOne(t, r); c.Res != -int32(unix.ENOBUFS) {
		t.Fatalf("completion %+v, want ENOBUFS", c)
	}
	b.Release(uint16(c.Flags >> 16))
	recv()
	if c := waitOne(t, r); c.Res != 5 {
		t.Fatalf("completion %+v after the buffer came back, want 5 bytes", c)
	}
}
