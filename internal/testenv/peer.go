package testenv

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Peer backends: real servers (nginx for TCP, socat for UDP) that answer every request with the
// address and port of the peer they saw, "addr port". They check what address an endpoint sees a
// proxied connection come from (the transparent source mode) with software that is not ours, so
// the answer is what any server's accept or recvfrom reports.

// peerNginxConf is StartNginxPeer's nginx.conf: %[1]s its directory, %[2]s the address it listens
// on. $remote_addr is the accepted socket's peer address (IPv6 without brackets).
const peerNginxConf = `daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log info;
events { worker_connections 64; }
http {
    access_log off;
    keepalive_timeout 0;
    client_body_temp_path %[1]s/body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    server {
        listen %[2]s;
        location / {
            default_type text/plain;
            return 200 "$remote_addr $remote_port\n";
        }
    }
}
`

// StartNginxPeer runs a real nginx, one process in the foreground with its files in a temporary
// directory, whose HTTP server at listen answers every request with the peer it accepted:
// "addr port" (ParsePeer reads it). prefix, if any, is prepended to the command (for example
// "ip netns exec pod1"). The test's cleanup stops it. It returns when nginx answers a request
// sent through dial (a dial from the namespace the test reaches listen from).
func StartNginxPeer(t testing.TB, listen netip.AddrPort, prefix []string, dial func(netip.AddrPort) (net.Conn, error)) {
	t.Helper()
	bin := FindNginx(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(fmt.Sprintf(peerNginxConf, dir, listen)), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, prefix...), bin, "-p", dir, "-c", path, "-e", filepath.Join(dir, "error.log"))
	exited := runNginx(t, dir, args)
	waitPeer(t, "nginx", listen, dir, exited, func() error {
		_, _, err := AskNginxPeer(dial, listen, time.Second)
		return err
	})
}

// AskNginxPeer sends one GET through a connection from dial to addr and returns the connection's
// own local address (what the client is) and the peer the server saw.
func AskNginxPeer(dial func(netip.AddrPort) (net.Conn, error), addr netip.AddrPort, timeout time.Duration) (local, seen netip.AddrPort, err error) {
	c, err := dial(addr)
	if err != nil {
		return local, seen, err
	}
	defer c.Close()
	local, err = netip.ParseAddrPort(c.LocalAddr().String())
	if err != nil {
		return local, seen, fmt.Errorf("local address of the connection to %s: %w", addr, err)
	}
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: peer\r\nConnection: close\r\n\r\n"); err != nil {
		return local, seen, fmt.Errorf("GET from %s to %s: %w", local, addr, err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return local, seen, fmt.Errorf("GET from %s to %s: read response: %w", local, addr, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 512))
	if err != nil || resp.StatusCode != http.StatusOK {
		return local, seen, fmt.Errorf("GET from %s to %s: %d %q, %v", local, addr, resp.StatusCode, body, err)
	}
	seen, err = ParsePeer(string(body))
	return local, seen, err
}

// FindSocat returns the socat binary, or ends the test as Unavailable (hack/install-deps.sh test).
func FindSocat(t testing.TB) string {
	t.Helper()
	path, err := exec.LookPath("socat")
	if err != nil {
		Unavailable(t, "socat is not installed (apt-get install socat, or hack/install-deps.sh test)")
	}
	return path
}

// StartSocatPeer runs socat receiving UDP datagrams on listen and answering each, from listen,
// with the peer it came from: "addr port" (socat's SOCAT_PEERADDR and SOCAT_PEERPORT; ParsePeer
// reads it). prefix is as StartNginxPeer's. The test's cleanup stops it. It returns when a
// datagram sent through dial is answered.
func StartSocatPeer(t testing.TB, listen netip.AddrPort, prefix []string, dial func(netip.AddrPort) (net.Conn, error)) {
	t.Helper()
	bin := FindSocat(t)
	dir := t.TempDir()
	family, bind := "UDP4", listen.Addr().String()
	if listen.Addr().Is6() {
		family, bind = "UDP6", "["+bind+"]"
	}
	// fork: a child per datagram answers it through the receiving socket, so the answer comes
	// from listen (bind) and goes to the datagram's source. The command reads a byte of the datagram
	// first: socat writes it to the command's stdin in one write, and a command that exited before
	// it did would fail the child with EPIPE before it answers.
	args := append(append([]string{}, prefix...), bin,
		fmt.Sprintf("%s-RECVFROM:%d,bind=%s,reuseaddr,fork", family, listen.Port(), bind),
		`SYSTEM:head -c1 >/dev/null; echo "$SOCAT_PEERADDR $SOCAT_PEERPORT"`)
	exited := runPeerProcess(t, "socat", dir, args)
	waitPeer(t, "socat", listen, dir, exited, func() error {
		_, _, err := AskSocatPeer(dial, listen, 500*time.Millisecond)
		return err
	})
}

// AskSocatPeer sends one datagram on a UDP socket from dial (connected to addr) and returns the
// socket's own local address and the peer the server saw.
func AskSocatPeer(dial func(netip.AddrPort) (net.Conn, error), addr netip.AddrPort, timeout time.Duration) (local, seen netip.AddrPort, err error) {
	c, err := dial(addr)
	if err != nil {
		return local, seen, err
	}
	defer c.Close()
	local, err = netip.ParseAddrPort(c.LocalAddr().String())
	if err != nil {
		return local, seen, fmt.Errorf("local address of the socket to %s: %w", addr, err)
	}
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("who\n")); err != nil {
		return local, seen, fmt.Errorf("UDP from %s to %s: %w", local, addr, err)
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return local, seen, fmt.Errorf("UDP from %s to %s: %w", local, addr, err)
	}
	seen, err = ParsePeer(string(buf[:n]))
	return local, seen, err
}

// ParsePeer reads a peer backend's answer, "addr port": the address as nginx ($remote_addr) or
// socat (SOCAT_PEERADDR: IPv6 in brackets, written out in full) prints it.
func ParsePeer(s string) (netip.AddrPort, error) {
	a, p, ok := strings.Cut(strings.TrimSpace(s), " ")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("peer answer %q: want \"addr port\"", s)
	}
	addr, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(a, "["), "]"))
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("peer answer %q: %w", s, err)
	}
	port, err := strconv.ParseUint(p, 10, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("peer answer %q: %w", s, err)
	}
	return netip.AddrPortFrom(addr.Unmap(), uint16(port)), nil
}

// runPeerProcess starts args with its output in dir/stderr until the test's cleanup kills it
// (logging that output if the test failed). The channel returned receives its exit.
func runPeerProcess(t testing.TB, what, dir string, args []string) chan error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	out, err := os.Create(filepath.Join(dir, "stderr"))
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		cancel()
		out.Close()
		t.Fatalf("start %s: %v", what, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cancel() // SIGKILL: nothing of its state matters after the test
		<-exited
		out.Close()
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "stderr"))
			t.Logf("%s output:\n%s", what, log)
		}
	})
	return exited
}

// waitPeer waits up to WaitTimeout until ask succeeds, failing at once with the server's output
// if it exits.
func waitPeer(t testing.TB, what string, listen netip.AddrPort, dir string, exited chan error, ask func() error) {
	t.Helper()
	deadline := time.Now().Add(WaitTimeout)
	for {
		select {
		case err := <-exited:
			exited <- err
			log, _ := os.ReadFile(filepath.Join(dir, "stderr"))
			t.Fatalf("%s exited: %v\n%s", what, err, log)
		default:
		}
		err := ask()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s to answer on %s: %v", WaitTimeout, what, listen, err)
		}
		time.Sleep(20 * time.Millisecond) // polling a condition with a deadline
	}
}
