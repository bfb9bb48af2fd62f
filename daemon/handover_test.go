package daemon

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// freeAddr returns 127.0.0.1:port with a port nothing listens on now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func logged(hook *logtest.Hook, msg string) map[string]any {
	for _, e := range hook.AllEntries() {
		if e.Message == msg {
			return e.Data
		}
	}
	return nil
}

// TestDaemonHandsOver runs two daemons on one --handover-socket, as a planned restart does: the
// second takes the first one's health and metrics listeners (it would fail to bind them
// otherwise), and the first stops serving but lets its established connection finish. Address
// plan: HTTP on 127.0.0.1 at fixed free ports (both daemons ask for the same), the echo endpoint
// on 127.0.0.1, proxy sockets on 127.0.0.1 at kernel-chosen ports.
func TestDaemonHandsOver(t *testing.T) {
	hs := startHandOverPair(t)
	first, stopFirst, args, healthz, metrics, exchange := hs.first, hs.stopFirst, hs.args, hs.healthz, hs.metrics, hs.exchange
	c := hs.c

	second := newHarness(t, args...)
	second.start(t)
	testenv.WaitFor(t, "the second daemon to take over and the first to hand over", func() bool {
		return logged(second.log, "Took over from the running proxy") != nil && logged(first.log, "Handed over to a successor: no longer syncing or accepting; finishing established connections, exiting at SIGTERM") != nil
	})
	took := logged(second.log, "Took over from the running proxy")
	if took["inherited"] != 2 {
		t.Errorf("inherited %v sockets, want 2 (health and metrics listeners); log fields %v", took["inherited"], took)
	}

	t.Run("the_successor_serves_the_health_and_metrics_addresses", func(t *testing.T) {
		if code, body := get(t, "http://"+healthz+"/healthz"); code != http.StatusOK {
			t.Errorf("GET /healthz = %d %q", code, body)
		}
		// The predecessor's servers close their copy of the shared listener just after it logs
		// the hand-over (their shutdown runs on its own goroutine): a request in between may
		// still reach it. The successor's answer comes once they have.
		wants := []string{`kube_portal_proxy_restart_sockets{origin="inherited"} 2`, `kube_portal_proxy_restart_sockets{origin="rebound"} 0`,
			`kube_portal_proxy_restart_service_ports{result="reallocated"} 0`, "kube_portal_proxy_handed_over 0"}
		var m string
		testenv.WaitFor(t, "the successor's restart series on /metrics", func() bool {
			_, m = get(t, "http://"+metrics+"/metrics")
			return strings.Contains(m, wants[0])
		})
		for _, want := range wants {
			if !strings.Contains(m, want) {
				t.Errorf("the successor's /metrics lacks %q", want)
			}
		}
	})
	t.Run("the_predecessor_finishes_its_connection", func(t *testing.T) {
		if err := exchange("after the hand-over"); err != nil {
			t.Fatal(err)
		}
	})
	c.Close()
	if err := stopFirst(); err != nil {
		t.Fatalf("the first daemon's Run: %v", err)
	}
	if lines := errorLines(first.log); len(lines) > 0 {
		t.Errorf("errors logged by the first daemon: %q", lines)
	}
	if code, _ := get(t, "http://"+healthz+"/healthz"); code != http.StatusOK {
		t.Errorf("GET /healthz after the first daemon exited = %d", code)
	}
}

func socketExists(flag string) bool {
	_, path, _ := strings.Cut(flag, "=")
	st, err := os.Stat(path)
	return err == nil && st.Mode()&os.ModeSocket != 0
}

// TestBindWhenFree: after a failed hand-over the running proxy may still hold the health and
// metrics addresses until it exits; binding them is retried, for a bounded time.
func TestBindWhenFree(t *testing.T) {
	inUse := &net.OpError{Op: "listen", Net: "tcp", Err: os.NewSyscallError("bind", syscall.EADDRINUSE)}
	for _, tc := range []struct {
		name      string
		busyCalls int // calls that fail with EADDRINUSE before one succeeds
		wantCalls int
		wantErr   bool
	}{
		{name: "address_in_use_until_the_old_process_lets_go", busyCalls: 3, wantCalls: 4},
		{name: "gives_up_after_the_bound", busyCalls: 1 << 30, wantCalls: int(bindRetryFor/(100*time.Millisecond)) + 1, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fc := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
			var calls atomic.Int64
			log, _ := logtest.NewNullLogger()
			d := &Daemon{o: &Options{handoverSocket: "/run/h.sock"}, log: log, deps: deps{clock: fc,
				listen: func(string) (net.Listener, error) {
					if calls.Add(1) <= int64(tc.busyCalls) {
						return nil, inUse
					}
					return net.Listen("tcp4", "127.0.0.1:0")
				}}}
			done := make(chan error, 1)
			go func() {
				ln, err := d.bindWhenFree(t.Context(), "127.0.0.1:10256")
				if ln != nil {
					ln.Close()
				}
				done <- err
			}()
			for {
				select {
				case err := <-done:
					if (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, syscall.EADDRINUSE)) {
						t.Errorf("bindWhenFree = %v, want error %v (EADDRINUSE)", err, tc.wantErr)
					}
					if got := calls.Load(); got != int64(tc.wantCalls) {
						t.Errorf("%d binds, want %d", got, tc.wantCalls)
					}
					return
				default:
				}
				if fc.HasWaiters() {
					fc.Step(100 * time.Millisecond)
				}
				runtime.Gosched()
			}
		})
	}
}

// TestAddressInUseWithoutHandOver: without --handover-socket an address in use fails the start,
// as before; with it, the start goes on.
func TestAddressInUseWithoutHandOver(t *testing.T) {
	held, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	for _, tc := range []struct {
		name     string
		handover string
		wantErr  bool
	}{
		{name: "fails_the_start", wantErr: true},
		{name: "served_later_with_a_hand-over_socket", handover: "/run/h.sock"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log, _ := logtest.NewNullLogger()
			d := &Daemon{o: &Options{handoverSocket: tc.handover}, log: log, deps: deps{clock: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)),
				listen: func(addr string) (net.Listener, error) { return net.Listen("tcp4", addr) }}}
			tasks, err := d.listenHTTP([]httpServer{{addr: held.Addr().String(), handler: http.NotFoundHandler()}}, nil)
			if (err != nil) != tc.wantErr || (err == nil && len(tasks) != 1) {
				t.Errorf("listenHTTP = %d tasks, %v; want error %v", len(tasks), err, tc.wantErr)
			}
		})
	}
}

// TestNotReadyWhileHandingOver: from the moment a successor holds the sockets until it is ready,
// /healthz (the readiness probe) fails, so the kubelet, whose probes of the old and the new pod
// land on either process, cannot mark the new pod Ready before it has taken over; /livez stays
// up. A successor that goes away makes the predecessor ready again. Address plan: HTTP on
// 127.0.0.1 at fixed free ports, the successor is this test holding the received sockets
// without serving them (so the predecessor answers every request).
func TestNotReadyWhileHandingOver(t *testing.T) {
	backend := echoServer(t)
	dir := t.TempDir()
	writeService(t, dir, "echo", "10.96.0.10", backend)
	healthz, sock := freeAddr(t), filepath.Join(t.TempDir(), "handover.sock")
	d := newHarness(t, "--services-file="+dir, "--iptables-min-sync-period=0", "--healthz-bind-address="+healthz,
		"--metrics-bind-address="+freeAddr(t), "--handover-socket="+sock)
	d.start(t)
	testenv.WaitFor(t, "the daemon to listen on the hand-over socket", func() bool {
		return logged(d.log, "No running proxy to take over from") != nil && socketExists("="+sock)
	})
	code := func(path string) int { c, _ := get(t, "http://"+healthz+path); return c }
	if c := code("/healthz"); c != http.StatusOK {
		t.Fatalf("GET /healthz before any successor = %d, want 200", c)
	}

	in, err := handover.Receive(t.Context(), sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "/healthz to fail while the successor is pending", func() bool { return code("/healthz") == http.StatusServiceUnavailable })
	if c := code("/livez"); c != http.StatusOK {
		t.Errorf("GET /livez during the hand-over = %d, want 200 (a liveness failure restarts the container)", c)
	}

	in.Close() // the successor dies before it is ready
	testenv.WaitFor(t, "/healthz to succeed again once the successor is gone", func() bool { return code("/healthz") == http.StatusOK })
}

// TestReadyFile: --ready-file appears once the daemon serves (first sync done, no predecessor)
// and is removed at exit. Address plan: HTTP on 127.0.0.1 at free ports, the echo endpoint on
// 127.0.0.1, the ready file and the hand-over socket in temporary directories.
func TestReadyFile(t *testing.T) {
	backend := echoServer(t)
	dir := t.TempDir()
	writeService(t, dir, "echo", "10.96.0.10", backend)
	ready := filepath.Join(t.TempDir(), "ready")
	for _, tc := range []struct{ name, handover string }{
		{"without_hand_over", ""},
		{"with_hand_over_socket", "--handover-socket=" + filepath.Join(t.TempDir(), "handover.sock")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"--services-file=" + dir, "--iptables-min-sync-period=0", "--healthz-bind-address=" + freeAddr(t),
				"--metrics-bind-address=" + freeAddr(t), "--ready-file=" + ready}
			if tc.handover != "" {
				args = append(args, tc.handover)
			}
			d := newHarness(t, args...)
			stop := d.start(t)
			testenv.WaitFor(t, "the ready file", func() bool { _, err := os.Stat(ready); return err == nil })
			if err := stop(); err != nil {
				t.Fatalf("Run: %v", err)
			}
			if _, err := os.Stat(ready); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("after exit the ready file is still there (%v)", err)
			}
		})
	}
}

// TestHandoverFailureIsExported checks kube_portal_proxy_handover_failed{step="receive"}, which the
// KubePortalProxyHandoverFailed alert reads: set when something answers on the hand-over socket
// but the sockets do not come (here: a listener that hangs up at once), not when nobody answers
// (a first start).
func TestHandoverFailureIsExported(t *testing.T) {
	for _, tc := range []struct {
		name   string
		listen bool // something accepts on the socket and hangs up
		want   float64
	}{
		{"nobody_answers_is_a_first_start", false, 0},
		{"a_broken_predecessor_is_a_failure", true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "handover.sock")
			if tc.listen {
				ln, err := net.Listen("unix", path)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { ln.Close() })
				go func() {
					for {
						c, err := ln.Accept()
						if err != nil {
							return
						}
						c.Close()
					}
				}()
			}
			log, _ := logtest.NewNullLogger()
			d := &Daemon{o: &Options{handoverSocket: path}, log: log}
			if in := d.receiveHandover(t.Context()); in != nil {
				in.Close()
				t.Fatal("receiveHandover returned sockets; want none")
			}
			stats := &restartStats{reopened: func() (int, int, int) { return 0, 0, 0 }, failed: &d.handoverFailed}
			reg := prometheus.NewPedanticRegistry()
			reg.MustRegister(stats.collector())
			mfs, err := reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]float64{}
			for _, mf := range mfs {
				if mf.GetName() != "kube_portal_proxy_handover_failed" {
					continue
				}
				for _, m := range mf.GetMetric() {
					got[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
				}
			}
			want := map[string]float64{"receive": tc.want, "ready": 0, "listen": 0}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("kube_portal_proxy_handover_failed by step (-want +got):\n%s", diff)
			}
		})
	}
}

// TestSIGTERMWhileSuccessorGetsReady: the DaemonSet controller (or a person) may SIGTERM the old
// process as soon as the new one says it took over, while the old one has not yet read the
// successor's ready, or before the successor is ready at all. The successor holds the sockets
// then; the old process must let its established connections finish, as after a hand-over,
// instead of resetting them. Address plan as TestDaemonHandsOver.
func TestSIGTERMWhileSuccessorGetsReady(t *testing.T) {
	hs := startHandOverPair(t)
	first, stopFirst, args, exchange := hs.first, hs.stopFirst, hs.args, hs.exchange

	second := newHarness(t, args...)
	second.start(t)
	testenv.WaitFor(t, "the first daemon to hand its sockets to the second", func() bool {
		return logged(first.log, "Handed the listening sockets to a successor; serving until it is ready") != nil
	})
	stopped := make(chan error, 1)
	go func() { stopped <- stopFirst() }() // SIGTERM; Run returns once the connection has finished
	testenv.WaitFor(t, "the first daemon to begin shutting down", func() bool {
		return logged(first.log, "Shutting down; portal rules stay in place so a restart does not black-hole services") != nil
	})
	if err := exchange("after SIGTERM"); err != nil {
		t.Fatalf("the first daemon's connection after its SIGTERM during the hand-over: %v", err)
	}
	hs.c.Close()
	if err := <-stopped; err != nil {
		t.Fatalf("the first daemon's Run: %v", err)
	}
	// The second one serves, whether its ready reached the first or found it gone.
	testenv.WaitFor(t, "the second daemon to take over", func() bool {
		return logged(second.log, "Took over from the running proxy") != nil ||
			logged(second.log, "Took over the running proxy's sockets, but could not tell it; it stops at its SIGTERM") != nil
	})
	hs.connect(t, second.portals.waitProxyPort(t, hs.echoName))
	if err := hs.exchange("to the second daemon"); err != nil {
		t.Fatal(err)
	}
}

// handOverPair is the first daemon of a hand-over test, serving one echo service port from a
// services file on --handover-socket, with a client connection through it that has exchanged once.
type handOverPair struct {
	args             []string
	healthz, metrics string
	echoName         service.ServicePortName
	first            *harness
	stopFirst        func() error
	c                net.Conn
	r                *bufio.Reader
}

func startHandOverPair(t *testing.T) *handOverPair {
	t.Helper()
	backend := echoServer(t)
	dir := t.TempDir()
	writeService(t, dir, "echo", "10.96.0.10", backend)
	hs := &handOverPair{healthz: freeAddr(t), metrics: freeAddr(t), echoName: service.ServicePortName{Namespace: "default", Name: "echo", Port: "tcp"}}
	hs.args = []string{"--services-file=" + dir, "--iptables-min-sync-period=0", "--healthz-bind-address=" + hs.healthz,
		"--metrics-bind-address=" + hs.metrics, "--handover-socket=" + filepath.Join(t.TempDir(), "run", "handover.sock")}
	hs.first = newHarness(t, hs.args...)
	hs.stopFirst = hs.first.start(t)
	proxyPort := hs.first.portals.waitProxyPort(t, hs.echoName)
	testenv.WaitFor(t, "the first daemon to listen on the hand-over socket", func() bool {
		return logged(hs.first.log, "No running proxy to take over from") != nil && socketExists(hs.args[4])
	})
	hs.connect(t, proxyPort)
	if err := hs.exchange("before"); err != nil {
		t.Fatal(err)
	}
	return hs
}

// connect makes the pair's client connection one to 127.0.0.1:port.
func (hs *handOverPair) connect(t *testing.T, port uint16) {
	t.Helper()
	c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatalf("dial the proxy port %d: %v", port, err)
	}
	t.Cleanup(func() { c.Close() })
	hs.c, hs.r = c, bufio.NewReader(c)
}

// exchange sends msg as a line and checks the echo.
func (hs *handOverPair) exchange(msg string) error {
	_ = hs.c.SetDeadline(time.Now().Add(waitFor))
	if _, err := fmt.Fprintln(hs.c, msg); err != nil {
		return err
	}
	got, err := hs.r.ReadString('\n')
	if err != nil || got != msg+"\n" {
		return fmt.Errorf("echo of %q: %q, %v", msg, got, err)
	}
	return nil
}
