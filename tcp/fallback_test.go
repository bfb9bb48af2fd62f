package tcp

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan: the proxies on 127.0.0.1, the echo endpoint on 127.0.0.3 (kernel-chosen ports);
// loopback only.

// injected is what the tests' ring faults fail with.
type injected struct {
	setupErr error
	// enterFails is how many io_uring_enter calls fail from now on, whichever loops make them.
	enterFails atomic.Int32
}

func (f *injected) setup() error { return f.setupErr }

func (f *injected) enter() error {
	if f.enterFails.Add(-1) >= 0 {
		return errors.New("io_uring_enter: injected: bad file descriptor")
	}
	f.enterFails.Store(0)
	return nil
}

// serveAsProxier serves p as the proxier does (proxier.serve): Start, and Run on a goroutine
// when Start says the engine needs one.
func serveAsProxier(t *testing.T, p *Proxy) {
	t.Helper()
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatalf("Listen: %v", err)
	}
	started, err := p.Start()
	if started {
		if err != nil {
			t.Errorf("Start: %v", err)
		}
		t.Cleanup(p.Shutdown)
		return
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(t.Context()) }()
	t.Cleanup(func() {
		p.Shutdown()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// servedWithin connects to p and expects its echo within a few seconds: a client left in the
// accept queue of a listener nobody accepts on would wait for ever.
func servedWithin(t *testing.T, p *Proxy, msg string) error {
	t.Helper()
	c, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(p.Addr()))
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := c.Read(buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return errors.New("echo " + string(buf) + ", want " + msg)
	}
	return nil
}

// engineLines are the lines logged at warning level or above that name the engine.
func engineLines(h *logtest.Hook) []string {
	var out []string
	for _, e := range h.AllEntries() {
		if e.Level <= logrus.WarnLevel && strings.Contains(e.Message, "io_uring") {
			out = append(out, e.Level.String()+": "+e.Message)
		}
	}
	return out
}

// TestIOUringStartFailureFallsBackToEpoll: the probe passed, but the engine's own rings cannot
// be set up (the probe's ring is smaller; memlock, a seccomp rule that counts). Before, the
// error stuck, the proxier kept the blocking listener that nobody accepted on, and clients
// waited in its queue for ever. Now both proxies, the one started as the proxier starts them and
// the one run, serve on the epoll engine, with one log line, and the failure counted.
func TestIOUringStartFailureFallsBackToEpoll(t *testing.T) {
	requireIOURing(t)
	log, hook := logtest.NewNullLogger()
	faults := &injected{setupErr: errors.New("io_uring_setup: injected: cannot allocate memory")}
	e := &uringEngine{threads: 2, faults: faults, log: log}
	t.Cleanup(func() { e.Close() })
	ep := serve(t, "127.0.0.3", echo)
	for _, name := range []string{"first", "second"} {
		p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Engine: e, Logger: log})
		serveAsProxier(t, p)
		if err := servedWithin(t, p, "served on epoll: "+name); err != nil {
			t.Fatalf("%s proxy: a client was not served after the io_uring engine failed to start: %v", name, err)
		}
	}
	st := e.Status()
	if st.Serving != EngineEpoll || st.StartFailures != 1 || st.LoopFailures != 0 || st.Err != nil {
		t.Errorf("Status = %+v, want serving on epoll, 1 start failure, no loop failure, no error", st)
	}
	if lines := engineLines(hook); len(lines) != 1 || !strings.Contains(lines[0], "epoll") {
		t.Errorf("logged %q, want one line saying the engine serves on epoll", lines)
	}
}

// TestIOUringLoopFailureFallsBackToEpoll: a loop whose io_uring_enter fails at run time (a
// broken ring) stopped with a line on stderr only, and the listeners it accepted on kept their
// rules: with every loop dead nothing accepted on them, and clients waited in the queue for
// ever. Now each death is logged, counted and reported as an error (the daemon fails /healthz
// with it), the connections of a dead loop are reset rather than left hanging, and every proxy
// accepts on the epoll engine from then on (the one the engine started and the one run), even
// when a loop is still alive: its connections go on, it accepts nothing more.
func TestIOUringLoopFailureFallsBackToEpoll(t *testing.T) {
	requireIOURing(t)
	for _, tt := range []struct {
		name string
		die  int32 // loops of 2
	}{
		{"one_loop_of_two", 1},
		{"every_loop", 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			log, hook := logtest.NewNullLogger()
			faults := &injected{}
			e := &uringEngine{threads: 2, faults: faults, log: log}
			t.Cleanup(func() { e.Close() })
			ep := serve(t, "127.0.0.3", echo)
			started := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Engine: e, Logger: log})
			serveAsProxier(t, started)
			run := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Engine: e, Logger: log})
			var before []*net.TCPConn
			for _, p := range []*Proxy{started, run} {
				c := dial(t, p)
				roundTrip(t, c, "on io_uring")
				before = append(before, c)
			}

			faults.enterFails.Store(tt.die)
			for _, l := range e.loops {
				l.post(func() {}) // wakes a loop waiting in the kernel: its next enter fails
			}
			testenv.WaitFor(t, "the loops to die", func() bool { return e.Status().LoopFailures == uint64(tt.die) })

			for i, p := range []*Proxy{started, run, started, run} {
				if err := servedWithin(t, p, "after the loop died"); err != nil {
					t.Fatalf("proxy %d: a client was not served after a loop died: %v", i%2, err)
				}
			}
			// A listener opened again after a refusal is the epoll engine's too.
			for i, p := range []*Proxy{started, run} {
				if err := p.SetRefusing(true); err != nil {
					t.Fatalf("proxy %d: SetRefusing(true): %v", i, err)
				}
				// A dead ring's requests (an accept on the old listener) are dropped by the
				// kernel's ring exit work, after the ring is closed: until then the address is
				// in use, and the proxier, as here, tries again (at its next sync).
				testenv.WaitFor(t, "the listener to open again", func() bool { return p.SetRefusing(false) == nil })
				if err := servedWithin(t, p, "reopened"); err != nil {
					t.Fatalf("proxy %d: a client was not served by the listener reopened after a loop died: %v", i, err)
				}
			}
			// A connection of a dead loop is reset; one of a live loop goes on. Neither hangs.
			for i, c := range before {
				c.SetDeadline(time.Now().Add(5 * time.Second))
				_, werr := c.Write([]byte("x"))
				_, rerr := c.Read(make([]byte, 1))
				var ne net.Error
				if errors.As(werr, &ne) && ne.Timeout() || errors.As(rerr, &ne) && ne.Timeout() {
					t.Errorf("connection %d made before the loop died hangs: %v, %v", i, werr, rerr)
				}
				// The first call after the RST reports it; the next sees the end (EOF).
				if rerr != nil && !errors.Is(werr, syscall.ECONNRESET) && !errors.Is(rerr, syscall.ECONNRESET) {
					t.Errorf("connection %d of a dead loop ended with %v, %v; want a reset", i, werr, rerr)
				}
			}
			st := e.Status()
			if st.Serving != EngineEpoll || st.LoopFailures != uint64(tt.die) || st.StartFailures != 0 || st.Err == nil || !strings.Contains(st.Err.Error(), "injected") {
				t.Errorf("Status = %+v, want serving on epoll, %d loop failures, an error with the cause", st, tt.die)
			}
			lines := engineLines(hook)
			if len(lines) != int(tt.die) {
				t.Errorf("logged %q, want one line per loop that died", lines)
			}
			for _, l := range lines {
				if !strings.HasPrefix(l, "error") || !strings.Contains(l, "epoll") {
					t.Errorf("logged %q, want an error saying a loop died and the engine serves on epoll", l)
				}
			}
		})
	}
}
