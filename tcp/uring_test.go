package tcp

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan: the proxy on 127.0.0.1, echo endpoints on 127.0.0.3 and 127.0.0.4 (kernel-chosen
// ports); loopback only.

// TestIOUringRingBuffersRunningOut: with one buffer in each loop's ring, most recvs find none
// (ENOBUFS) and their directions fall back to a poll and a read into a pooled buffer; every byte
// still arrives, in order, on every connection.
func TestIOUringRingBuffersRunningOut(t *testing.T) {
	requireIOURing(t)
	e := &uringEngine{threads: 2, ringBufs: 1}
	t.Cleanup(func() { e.Close() }) // after the proxy's Shutdown (cleanups run last first)
	ep1, ep2 := serve(t, "127.0.0.3", echo), serve(t, "127.0.0.4", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep1, ep2}}, Config{Engine: e})
	const clients = 50
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		wg.Go(func() {
			c, err := net.Dial("tcp4", p.Addr().String())
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			for j := range 20 {
				msg := fmt.Sprintf("client %d message %d %0900d", i, j, j)
				c.Write([]byte(msg))
				buf := make([]byte, len(msg))
				if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
					errs <- fmt.Errorf("client %d: got %.40q, %v; want %.40q", i, buf, err, msg)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestIOUringCloseEndsWhatIsLeft: an engine closed under an open connection closes it and ends
// it, so the proxy's Shutdown does not wait for it forever, and the client sees its connection end.
func TestIOUringCloseEndsWhatIsLeft(t *testing.T) {
	requireIOURing(t)
	e := &uringEngine{threads: 1}
	ep := serve(t, "127.0.0.3", echo)
	closed := make(closedCh, 1)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Engine: e, Logger: testLogger(t), OnEnd: closed.onClose})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(t.Context()) }()
	c := dial(t, p)
	roundTrip(t, c, "hello")
	p.Close()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	e.Close()
	closed.next(t)
	shut := make(chan struct{})
	go func() { p.Shutdown(); close(shut) }()
	select {
	case <-shut:
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown after the engine closed did not return")
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the client's connection is still open")
	}
}

// TestAdoptionKeepsTheSharedNonBlockingFlag: a listening socket handed over is shared with the
// predecessor until it exits, O_NONBLOCK included. The io_uring engine leaves the flag as it
// finds it (a predecessor on the epoll engine needs it set); the epoll engine sets it. Either way
// the adopted socket serves.
func TestAdoptionKeepsTheSharedNonBlockingFlag(t *testing.T) {
	requireIOURing(t)
	e := NewIOUring(1)
	t.Cleanup(func() { e.Close() })
	backend := serve(t, "127.0.0.3", echo)
	for _, tt := range []struct {
		name        string
		engine      Engine
		nonblocking bool // the predecessor's flag
		want        bool
	}{
		{"io_uring_keeps_non_blocking", e, true, true},
		{"io_uring_keeps_blocking", e, false, false},
		{"epoll_sets_non_blocking", Epoll, false, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			typ := unix.SOCK_STREAM | unix.SOCK_CLOEXEC
			if tt.nonblocking {
				typ |= unix.SOCK_NONBLOCK
			}
			pred, addr := rawListener(t, typ, 16)
			defer unix.Close(pred)
			fd, err := unix.Dup(pred) // as SCM_RIGHTS delivers it: the same open file
			if err != nil {
				t.Fatal(err)
			}
			p := New(testName, &fakePicker{eps: []netip.AddrPort{backend}}, Config{Logger: testLogger(t), Engine: tt.engine,
				Adopt: func(netip.AddrPort) (int, bool) { return fd, true }})
			if err := p.Listen(addr); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- p.Run(ctx) }()
			defer func() { cancel(); p.Shutdown(); <-done }()
			flags, err := unix.FcntlInt(uintptr(pred), unix.F_GETFL, 0)
			if err != nil {
				t.Fatal(err)
			}
			if got := flags&unix.O_NONBLOCK != 0; got != tt.want {
				t.Errorf("the predecessor's socket is non-blocking: %v, want %v", got, tt.want)
			}
			c, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(addr))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(20 * time.Second))
			roundTrip(t, c, "through the adopted socket")
		})
	}
}

// TestStopAcceptingStrandsNoConnection: two io_uring engines (a process and its successor after
// a hand-over) accept on the same listening socket while a client connects again and again, each
// time once it had its answer; then the first stops accepting. Every connection must be served:
// the kernel wakes one exclusive waiter per connection, and an accept being cancelled spends the
// wake-up without accepting, which before left the connection in the queue until the next one
// came (each of 3 runs stranded one within its 100 rounds; this client, waiting for it, never
// sent the next).
func TestStopAcceptingStrandsNoConnection(t *testing.T) {
	requireIOURing(t)
	oldE, newE := NewIOUring(2), NewIOUring(2)
	t.Cleanup(func() { oldE.Close(); newE.Close() })
	backend := serve(t, "127.0.0.3", echo)
	for iter := range 100 {
		ln, addr := rawListener(t, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 128) // blocking, as the engine's own
		start := func(e Engine) *Proxy {
			fd, err := unix.Dup(ln) // as SCM_RIGHTS delivers it: the same open file
			if err != nil {
				t.Fatal(err)
			}
			p := New(testName, &fakePicker{eps: []netip.AddrPort{backend}}, Config{Logger: testLogger(t), Engine: e,
				Adopt: func(netip.AddrPort) (int, bool) { return fd, true }})
			if err := p.Listen(addr); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Start(); err != nil {
				t.Fatal(err)
			}
			return p
		}
		old, successor := start(oldE), start(newE)
		unix.Close(ln)

		var served atomic.Int64
		stop := make(chan struct{})
		failed := make(chan error, 1)
		go func() {
			defer close(failed)
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := echoOnce(addr, strconv.Itoa(n)); err != nil {
					failed <- err
					return
				}
				served.Add(1)
			}
		}()
		// Stop accepting after a number of answers that varies with the round, so the cancel
		// meets the client's connections at different points.
		before := int64(1 + iter%7)
		testenv.WaitFor(t, "the client's first answers", func() bool { return served.Load() >= before })
		old.Close()
		after := served.Load() + 20
		testenv.WaitFor(t, "20 answers after the first process stopped accepting", func() bool {
			select {
			case err := <-failed:
				t.Fatalf("round %d: a connection made while the first process stopped accepting: %v", iter, err)
			default:
			}
			return served.Load() >= after
		})
		close(stop)
		if err := <-failed; err != nil {
			t.Fatalf("round %d: %v", iter, err)
		}
		successor.Shutdown()
		old.Shutdown()
	}
}

// echoOnce connects to addr, sends msg and reads the echo within a second.
func echoOnce(addr netip.AddrPort, msg string) error {
	c, err := net.DialTimeout("tcp4", addr.String(), time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	_, err = io.ReadFull(c, buf)
	return err
}

// rawListener opens a listening IPv4 socket of type typ on 127.0.0.1 at a kernel-chosen port, as a
// predecessor's would be, with backlog; the caller closes it.
func rawListener(t *testing.T, typ, backlog int) (int, netip.AddrPort) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, typ, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	if err := unix.Listen(fd, backlog); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	sa, _ := unix.Getsockname(fd)
	return fd, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(sa.(*unix.SockaddrInet4).Port))
}

// TestIOUringIdleConnectionsHoldNoRingBuffer: a keep-alive connection waiting for its next
// request holds none of its loop's ring buffers. Each direction once held the buffer it had sent
// until its next recv completed, so 64 idle keep-alive connections held all 128 buffers of a
// loop, and every further recv found the ring empty and fell back to a poll and a read of its own.
func TestIOUringIdleConnectionsHoldNoRingBuffer(t *testing.T) {
	requireIOURing(t)
	e := &uringEngine{threads: 1, ringBufs: 16}
	t.Cleanup(func() { e.Close() })
	ep := serve(t, "127.0.0.3", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Engine: e})
	for i := range 4 {
		roundTrip(t, dial(t, p), "hello "+strconv.Itoa(i))
	}
	e.mu.Lock()
	l := e.loops[0]
	e.mu.Unlock()
	held := func() int {
		ch := make(chan int, 1)
		if !l.post(func() { ch <- l.bufsOut }) {
			t.Fatal("the loop stopped")
		}
		return <-ch
	}
	// The client has the answer once the send is done; the loop hears of it in its next round.
	n := held()
	for deadline := time.Now().Add(2 * time.Second); n > 0 && time.Now().Before(deadline); n = held() {
		runtime.Gosched()
	}
	if n > 0 {
		t.Errorf("4 idle keep-alive connections hold %d ring buffers; want none", n)
	}
}
