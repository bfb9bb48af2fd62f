package udp

import (
	"net/netip"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// bufSize holds any UDP datagram: the largest IPv4 payload is 65,507 bytes and IPv6 (without
// jumbograms) 65,527. The legacy proxy's 4 KiB buffer silently truncated larger datagrams.
const bufSize = 64 << 10

// maxBatch bounds how many datagrams one recvmmsg/sendmmsg call moves. Each slot owns a 64 KiB
// buffer, so a batch costs maxBatch*2*64 KiB of address space, but only the pages datagrams
// touch become resident.
const maxBatch = 32

// maxLoops bounds Config.Loops.
const maxLoops = 16

// DefaultLoops is how many loops serve a UDP service port by default. One loop used less CPU per
// exchange than nginx's two workers but reached a lower rate on a quiet machine (bench/RESULTS.md,
// issue 25): it ran at about 60% of one CPU, so a second loop in parallel was the lever. On this
// 2-CPU machine under load it did not win: each loop sees half the traffic, so it wakes more often
// per exchange (0.37 against 0.25 context switches per exchange, replies per sendmmsg 5.8 against
// 8.5) and used 8-35% more CPU per exchange in iptables portal mode; and every busy loop holds a
// P while blocked in epoll_wait, so with GOMAXPROCS 2 two loops leave other goroutines waiting
// for sysmon to retake a P (BenchmarkRoundTrip: 13-25k against 29-74k exchanges/s for one loop;
// with -cpu 4 two loops were ahead). So one loop stays the default; --udp-loops sets more.
const DefaultLoops = 1

// DefaultBatchSize is the recvmmsg/sendmmsg vector length. See Config.BatchSize for how it was
// chosen.
const DefaultBatchSize = 16

// msgs is a vector of datagram slots for recvmmsg or sendmmsg.
type msgs struct {
	hdrs  [maxBatch]unix.Mmsghdr
	iovs  [maxBatch]unix.Iovec
	names [maxBatch]sockaddr
	ctrls [maxBatch]control
	bufs  [maxBatch]*[bufSize]byte
}

// prepareRecv readies slots [from, to) to receive datagrams, with their source address and
// packet info when fromListener is set.
func (m *msgs) prepareRecv(from, to int, fromListener bool) {
	for i := from; i < to; i++ {
		if m.bufs[i] == nil {
			m.bufs[i] = new([bufSize]byte)
		}
		m.iovs[i].Base = &m.bufs[i][0]
		m.iovs[i].SetLen(bufSize)
		h := &m.hdrs[i]
		*h = unix.Mmsghdr{}
		h.Hdr.Iov = &m.iovs[i]
		h.Hdr.SetIovlen(1)
		if fromListener {
			h.Hdr.Name = (*byte)(unsafe.Pointer(&m.names[i]))
			h.Hdr.Namelen = sockaddrLen
			h.Hdr.Control = (*byte)(unsafe.Pointer(&m.ctrls[i]))
			h.Hdr.SetControllen(controlLen)
		}
	}
}

// data is the datagram a recvmmsg left in slot i.
func (m *msgs) data(i int) []byte { return m.bufs[i][:m.hdrs[i].Len] }

// truncated reports whether the kernel cut the datagram in slot i (it cannot with 64 KiB buffers,
// but a drop is better than forwarding a corrupt datagram).
func (m *msgs) truncated(i int) bool { return m.hdrs[i].Hdr.Flags&unix.MSG_TRUNC != 0 }

// local is the address the datagram in slot i was delivered to, if known.
func (m *msgs) local(i int) (netip.Addr, bool) {
	return localAddr(&m.ctrls[i], int(m.hdrs[i].Hdr.Controllen))
}

// addressReply turns received slot i into a datagram to s's client, from s's local address.
func (m *msgs) addressReply(i int, s *session) {
	m.iovs[i].SetLen(int(m.hdrs[i].Len))
	h := &m.hdrs[i].Hdr
	h.Name = (*byte)(unsafe.Pointer(&s.clientAddr))
	h.Namelen = s.clientAddrLen
	if s.replyCtrlLen > 0 {
		h.Control = (*byte)(unsafe.Pointer(&s.replyCtrl))
		h.SetControllen(s.replyCtrlLen)
	}
}

// batch is the scratch space of one pass of the proxy loop: client datagrams in, replies out.
// Batches are pooled across all proxies, so an idle service port holds no buffers.
type batch struct {
	in   msgs
	out  msgs
	outN int // replies queued in out
}

var batchPool = sync.Pool{New: func() any { return new(batch) }}

// move makes slot w hold the datagram received in slot i (w <= i), swapping buffers, not bytes.
func (m *msgs) move(i, w int) {
	if i == w {
		return
	}
	m.bufs[w], m.bufs[i] = m.bufs[i], m.bufs[w]
	m.hdrs[w].Len = m.hdrs[i].Len
	m.iovs[w].Base = &m.bufs[w][0]
}
