package tcp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

const emfileChildEnv = "KPP_TCP_EMFILE_CHILD_ENDPOINT"

// TestAcceptBacksOffOnEMFILE runs the proxy in a child process (this test binary re-executed) whose
// RLIMIT_NOFILE leaves room for only a few connections. A client beyond that waits, either in the
// backlog while the accept loop backs off, or accepted with the last descriptor while its dial backs
// off; it is never reset. Once earlier clients close, the waiting one is served. The child must
// neither die nor spin.
func TestAcceptBacksOffOnEMFILE(t *testing.T) {
	if ep := os.Getenv(emfileChildEnv); ep != "" {
		emfileChild(ep)
		return
	}
	ep := serve(t, "127.0.0.3", echo)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestAcceptBacksOffOnEMFILE$")
	cmd.Env = append(os.Environ(), emfileChildEnv+"="+ep.String())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatalf("start child: %v", err)
	}
	addr, err := readChildAddr(stdout)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("child did not report its address: %v\n%s", err, stderr.String())
	}

	// Open clients until one is not served: it is waiting in the backlog.
	var served []net.Conn
	var waiting net.Conn
	for i := 0; i < 50 && waiting == nil; i++ {
		c, err := net.Dial("tcp4", addr)
		if err != nil {
			t.Fatalf("dial child proxy: %v", err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(300 * time.Millisecond))
		c.Write([]byte("ping"))
		if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				t.Fatalf("client %d: %v, want echo or a wait in the backlog\n%s", i, err, stderr.String())
			}
			waiting = c
			break
		}
		served = append(served, c)
	}
	if waiting == nil || len(served) == 0 {
		t.Fatalf("served %d clients and none waited: the descriptor limit did not bite\n%s", len(served), stderr.String())
	}
	for _, c := range served {
		c.Close()
	}
	waiting.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(waiting, make([]byte, 4)); err != nil {
		t.Fatalf("waiting client not served after others closed: %v\n%s", err, stderr.String())
	}
	stdin.Close() // tells the child to exit
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child exited with %v\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "backing off") {
		t.Errorf("child log has no accept back-off warning:\n%s", stderr.String())
	}
}

func readChildAddr(r io.Reader) (string, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if a, ok := strings.CutPrefix(sc.Text(), "ADDR "); ok {
			go io.Copy(io.Discard, r)
			return a, nil
		}
	}
	return "", fmt.Errorf("no ADDR line: %v", sc.Err())
}

// emfileChild serves until stdin closes, with a descriptor limit a few above what it uses at start.
func emfileChild(endpoint string) {
	log := logrus.New()
	log.SetOutput(os.Stderr)
	p := New(testName, &fakePicker{eps: []netip.AddrPort{netip.MustParseAddrPort(endpoint)}},
		Config{Logger: log, ParkAfter: time.Millisecond})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	go p.Run(context.Background())
	fds, _ := os.ReadDir("/proc/self/fd")
	// Room for about three proxied connections (2 sockets each), one pipe pair and the idle
	// watcher's epoll set (created when the first connection parks).
	lim := unix.Rlimit{Cur: uint64(len(fds) + 9), Max: uint64(len(fds) + 9)}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fmt.Printf("ADDR %s\n", p.Addr())
	io.Copy(io.Discard, os.Stdin)
	p.Shutdown()
	os.Exit(0)
}

const emfileAffinityChildEnv = "KPP_TCP_EMFILE_AFFINITY_CHILD_ENDPOINTS"

// TestDialEMFILEKeepsAffinity: a client whose endpoint is picked by ClientIP affinity keeps it when
// the proxy's dial fails for want of descriptors (EMFILE), which is the proxy's fault, not the
// endpoint's: the next attempt of the ladder asks the picker again without reset (which would move
// the client to another endpoint), and the endpoint is not reported as failed. The proxy runs in a
// child process (this test binary re-executed, on the engine of this run) that uses up its
// descriptor limit but one, so the client is accepted and the first attempt's dials all get
// EMFILE; the picker's second call frees the descriptors. Endpoints A (127.0.0.3) and B
// (127.0.0.5) greet with their address; the picker is sticky: A until reset, then B.
func TestDialEMFILEKeepsAffinity(t *testing.T) {
	if eps := os.Getenv(emfileAffinityChildEnv); eps != "" {
		emfileAffinityChild(eps)
		return
	}
	greet := func(c *net.TCPConn) {
		fmt.Fprintf(c, "%s\n", c.LocalAddr())
		echo(c)
	}
	a, b := serve(t, "127.0.0.3", greet), serve(t, "127.0.0.5", greet)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestDialEMFILEKeepsAffinity$")
	cmd.Env = append(os.Environ(), emfileAffinityChildEnv+"="+a.String()+","+b.String())
	stderr := &testenv.SyncBuffer{}
	cmd.Stderr = stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatalf("start child: %v", err)
	}
	lines := make(chan string, 16)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var addr string
	for l := range lines {
		if a, ok := strings.CutPrefix(l, "ADDR "); ok {
			addr = a
			break
		}
	}
	if addr == "" {
		cmd.Wait()
		t.Fatalf("child did not report its address\n%s", stderr.String())
	}

	c, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatalf("dial child proxy: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	greeting, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("client not served: %v\n%s", err, stderr.String())
	}
	if got := strings.TrimSpace(greeting); got != a.String() {
		t.Errorf("served by %s, want the affinity endpoint %s (B is %s)", got, a, b)
	}
	stdin.Close() // tells the child to report and exit
	var report []string
	for l := range lines {
		report = append(report, l)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("child exited with %v\n%s", err, stderr.String())
	}
	want := []string{
		"pick reset=false " + a.String(),
		"flow-done " + a.String(), // the attempt abandoned for EMFILE: not the endpoint's failure
		"pick reset=false " + a.String(),
		"dial-done " + a.String() + " <nil>",
	}
	if d := cmp.Diff(want, report); d != "" {
		t.Errorf("the child's picks and reports to the picker (-want +got):\n%s\n%s", d, stderr.String())
	}
	if !strings.Contains(stderr.String(), "out of resources, backing off") {
		t.Errorf("child log has no dial back-off warning (did the dial meet EMFILE?):\n%s", stderr.String())
	}
}

// stickyPicker is ClientIP affinity over two endpoints: eps[0] until a pick with reset, then the
// other. Its second Next first closes fillers (the descriptors the child used up). It records its
// calls and the Observer reports.
type stickyPicker struct {
	mu      sync.Mutex
	eps     [2]netip.AddrPort
	cur     int
	calls   int
	fillers []int
	log     []string
}

func (s *stickyPicker) Next(_ netip.Addr, reset bool) (netip.AddrPort, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if s.calls == 2 {
		for _, fd := range s.fillers {
			unix.Close(fd)
		}
		s.fillers = nil
	}
	if reset {
		s.cur = 1 - s.cur
	}
	s.log = append(s.log, fmt.Sprintf("pick reset=%v %s", reset, s.eps[s.cur]))
	return s.eps[s.cur], nil
}

func (s *stickyPicker) DialDone(ep netip.AddrPort, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.log = append(s.log, fmt.Sprintf("dial-done %s %v", ep, err))
}

func (s *stickyPicker) FlowDone(ep netip.AddrPort, reset bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.flowDoneAfterServed(ep) {
		s.log = append(s.log, fmt.Sprintf("flow-done %s", ep))
	}
}

// flowDoneAfterServed: the served connection's own FlowDone (at shutdown) is not part of the dial.
func (s *stickyPicker) flowDoneAfterServed(ep netip.AddrPort) bool {
	for _, l := range s.log {
		if l == fmt.Sprintf("dial-done %s <nil>", ep) {
			return true
		}
	}
	return false
}

// emfileAffinityChild serves one client with its descriptors used up but one, then, once stdin
// closes, prints the picker's log and exits.
func emfileAffinityChild(eps string) {
	log := logrus.New()
	log.SetOutput(os.Stderr)
	a, b, _ := strings.Cut(eps, ",")
	picker := &stickyPicker{eps: [2]netip.AddrPort{netip.MustParseAddrPort(a), netip.MustParseAddrPort(b)}}
	p := New(testName, picker, Config{Logger: log, ParkAfter: time.Minute,
		DialTimeouts: []time.Duration{300 * time.Millisecond, 2 * time.Second}})
	if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	// Serving must be set up (the io_uring engine's rings opened) before the descriptors run out.
	if started, err := p.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	} else if !started {
		go p.Run(context.Background())
	}
	fds, _ := os.ReadDir("/proc/self/fd")
	lim := unix.Rlimit{Cur: uint64(len(fds) + 16), Max: uint64(len(fds) + 16)}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	picker.mu.Lock()
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			break // EMFILE: the limit is reached
		}
		picker.fillers = append(picker.fillers, fd)
	}
	// One free descriptor: the client's accept takes it, and the dial finds none.
	n := len(picker.fillers) - 1
	unix.Close(picker.fillers[n])
	picker.fillers = picker.fillers[:n]
	picker.mu.Unlock()
	fmt.Printf("ADDR %s\n", p.Addr())
	io.Copy(io.Discard, os.Stdin)
	p.Shutdown()
	picker.mu.Lock()
	for _, l := range picker.log {
		fmt.Println(l)
	}
	picker.mu.Unlock()
	os.Exit(0)
}
