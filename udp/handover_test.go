package udp

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestHandOver: a successor's proxy adopts the predecessor's socket, and a released predecessor
// leaves new datagrams to the successor while its own sessions still get their replies.
// Address plan: proxy sockets on 127.0.0.1, backends on 127.0.0.2, clients on 127.0.0.1.
func TestHandOver(t *testing.T) {
	t.Run("an adopted socket proxies the datagram queued before the hand-over", func(t *testing.T) {
		backend := echoServer(t, "127.0.0.2", "echo:")
		old, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.1:0")))
		if err != nil {
			t.Fatal(err)
		}
		addr := old.LocalAddr().(*net.UDPAddr).AddrPort()
		c := newClient(t, "127.0.0.1", addr)
		c.send([]byte("queued")) // waits in the socket's queue: nobody reads yet
		fd := dupOf(t, old)
		p := New(testService, newFakePicker(backend), Config{Logger: quietLogger(),
			Adopt: func(a netip.AddrPort) (int, bool) { return fd, a == addr }})
		if err := p.Listen(addr); err != nil {
			t.Fatalf("Listen with an adopted socket: %v", err)
		}
		old.Close()
		if !p.Adopted() {
			t.Error("Adopted() = false after Listen took the handed-over socket")
		}
		runProxy(t, p)
		got, err := c.recv()
		if err != nil || string(got) != "echo:queued" {
			t.Fatalf("reply %q, %v; want echo:queued", got, err)
		}
	})

	t.Run("a released proxy leaves new clients to its successor and relays its sessions' replies", func(t *testing.T) {
		fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		backend, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.2:0")))
		if err != nil {
			t.Fatal(err)
		}
		defer backend.Close()
		p := startProxy(t, newFakePicker(backend.LocalAddr().(*net.UDPAddr).AddrPort()),
			Config{IdleTimeout: 10 * time.Second, Clock: fc, Logger: quietLogger(), Loops: 1}) // several: TestLoopsHandOver
		s := p.shardList()[0]
		s.mu.Lock()
		succFD, err := unix.Dup(s.lfd) // the successor holds the same socket, as after a hand-over
		s.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		succ := packetConn(t, succFD)

		a := newClient(t, "127.0.0.1", p.Addr())
		a.send([]byte("a1"))
		buf := make([]byte, 64)
		backend.SetReadDeadline(time.Now().Add(waitTimeout))
		n, session, err := backend.ReadFromUDPAddrPort(buf)
		if err != nil || string(buf[:n]) != "a1" {
			t.Fatalf("backend read %q, %v; want a1", buf[:n], err)
		}

		p.Release()
		if _, err := backend.WriteToUDPAddrPort([]byte("r1"), session); err != nil {
			t.Fatal(err)
		}
		if got, err := a.recv(); err != nil || string(got) != "r1" {
			t.Fatalf("the released proxy's session: reply %q, %v; want r1", got, err)
		}
		b := newClient(t, "127.0.0.1", p.Addr())
		b.send([]byte("b1"))
		succ.SetReadDeadline(time.Now().Add(waitTimeout))
		n, from, err := succ.ReadFrom(buf)
		if err != nil || string(buf[:n]) != "b1" || from.(*net.UDPAddr).AddrPort() != b.addr() {
			t.Fatalf("successor read %q from %v, %v; want b1 from %v", buf[:n], from, err, b.addr())
		}
		if n := len(p.Live()); n != 1 {
			t.Errorf("the released proxy has %d sessions, want its one old session", n)
		}
		select {
		case <-p.Drained():
			t.Fatal("drained while a session is live")
		default:
		}
		stepAndSweep(t, fc, 11*time.Second)
		testenv.WaitFor(t, "the released proxy to report drained", func() bool {
			select {
			case <-p.Drained():
				return true
			default:
				return false
			}
		})
	})
}

// TestReleasedProxyEndsAnsweredSessions: once released, a session whose client got its answer ends
// after a quiet second, not at the idle timeout, so the old process of a hand-over is not kept up
// to its drain deadline by idle clients; a session still waiting for its reply is kept (until the
// idle timeout) and relays that reply.
func TestReleasedProxyEndsAnsweredSessions(t *testing.T) {
	fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	backend, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.2:0")))
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close()
	p := startProxy(t, newFakePicker(backend.LocalAddr().(*net.UDPAddr).AddrPort()),
		Config{IdleTimeout: time.Minute, Clock: fc, Logger: quietLogger()})
	buf := make([]byte, 64)
	request := func(c *client, msg string) netip.AddrPort {
		t.Helper()
		c.send([]byte(msg))
		backend.SetReadDeadline(time.Now().Add(waitTimeout))
		n, session, err := backend.ReadFromUDPAddrPort(buf)
		if err != nil || string(buf[:n]) != msg {
			t.Fatalf("backend read %q, %v; want %s", buf[:n], err, msg)
		}
		return session
	}
	reply := func(c *client, session netip.AddrPort, msg string) {
		t.Helper()
		if _, err := backend.WriteToUDPAddrPort([]byte(msg), session); err != nil {
			t.Fatal(err)
		}
		if got, err := c.recv(); err != nil || string(got) != msg {
			t.Fatalf("reply %q, %v; want %s", got, err, msg)
		}
	}
	answered, waiting := newClient(t, "127.0.0.1", p.Addr()), newClient(t, "127.0.0.1", p.Addr())
	reply(answered, request(answered, "a1"), "ra1")
	slow := request(waiting, "w1") // its reply is late

	p.Release()
	stepAndSweep(t, fc, time.Second)
	live := p.Live()
	if len(live) != 1 || live[0].Client != waiting.addr() {
		t.Fatalf("live sessions a quiet second after Release: %v; want only the one waiting for its reply (%v)", live, waiting.addr())
	}
	reply(waiting, slow, "rw1") // the late reply still reaches its client
	stepAndSweep(t, fc, time.Second)
	testenv.WaitFor(t, "the released proxy to report drained", func() bool {
		select {
		case <-p.Drained():
			return true
		default:
			return false
		}
	})
	if st := p.Stats(); st.Ended[flow.IdleTimeout] != 2 {
		t.Errorf("Stats().Ended = %v, want 2 idle-timeout", st.Ended)
	}
}

func dupOf(t *testing.T, c *net.UDPConn) int {
	t.Helper()
	f, err := c.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

func packetConn(t *testing.T, fd int) net.PacketConn {
	t.Helper()
	f := os.NewFile(uintptr(fd), "successor")
	defer f.Close()
	pc, err := net.FilePacketConn(f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	return pc
}

func runProxy(t *testing.T, p *Proxy) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func quietLogger() *logrus.Logger {
	l := logrus.New()
	l.SetOutput(io.Discard)
	return l
}

// gatePicker is a Gate that records whether a pick happened before it opened.
type gatePicker struct {
	*fakePicker
	ready  chan struct{}
	opened atomic.Bool
	early  atomic.Int64
}

func (g *gatePicker) Ready() <-chan struct{} { return g.ready }

func (g *gatePicker) Next(client netip.Addr, reset bool) (netip.AddrPort, error) {
	if !g.opened.Load() {
		g.early.Add(1)
	}
	return g.fakePicker.Next(client, reset)
}

// TestGate: a proxy whose picker cannot pick yet (a restarted proxy before its endpoints are in)
// reads nothing; the datagram waits in the queue and is answered once the gate opens.
func TestGate(t *testing.T) {
	backend := echoServer(t, "127.0.0.2", "echo:")
	g := &gatePicker{fakePicker: newFakePicker(backend), ready: make(chan struct{})}
	p := startProxy(t, g, Config{Logger: quietLogger()})
	c := newClient(t, "127.0.0.1", p.Addr())
	c.send([]byte("early"))
	testenv.WaitFor(t, "Run to start", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.running
	})
	g.opened.Store(true)
	close(g.ready)
	got, err := c.recv()
	if err != nil || string(got) != "echo:early" {
		t.Fatalf("reply %q, %v; want echo:early (queued until the gate opened, not dropped)", got, err)
	}
	if n := g.early.Load(); n != 0 {
		t.Errorf("%d picks before the gate opened", n)
	}
}
