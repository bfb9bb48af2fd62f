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
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
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
