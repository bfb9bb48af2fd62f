package main

// child.go runs processes inside a namespace (`ip netns exec`): this binary in another role
// (backend, client) and the proxies. Every child dies with the harness (PR_SET_PDEATHSIG survives
// ip's exec) and is stopped by closing its stdin or by a signal.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// child is one running process.
type child struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *bufio.Reader
	exited chan struct{}
	// closeOut closes the read end of stdout; stop calls it once the child is gone.
	closeOut func() error
}

// startChild runs argv in ns. stderr goes to errw (nil: the harness's stderr); stdout is read
// with line.
func startChild(ctx context.Context, ns *netns.NS, name string, errw io.Writer, argv ...string) (*child, error) {
	args := append(ns.CommandPrefix(), argv...)
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = errw
	if errw == nil {
		cmd.Stderr = os.Stderr
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	// Not StdoutPipe: Wait (in the goroutine below) closes that pipe as soon as the child exits,
	// and a client that prints its result and exits at once would lose it ("file already
	// closed"). The read end of an os.Pipe is ours; it reads the rest, then EOF.
	stdout, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		stdout.Close()
		return nil, fmt.Errorf("%s: start: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, stdin: stdin, out: bufio.NewReader(stdout), exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.exited) }()
	c.closeOut = stdout.Close
	return c, nil
}

// startSelf runs this binary in another role inside ns.
func startSelf(ctx context.Context, ns *netns.NS, role string, args ...string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return startChild(ctx, ns, role, nil, append([]string{self, "-role", role}, args...)...)
}

// pid is the child's PID: `ip netns exec` execs the command, so it is the command's own.
func (c *child) pid() int { return c.cmd.Process.Pid }

// line reads one line of the child's stdout (the context of startChild bounds it).
func (c *child) line() (string, error) {
	s, err := c.out.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("%s: read: %w", c.name, err)
	}
	return strings.TrimSpace(s), nil
}

// stop closes stdin, sends sig (0: none) and waits up to grace before killing.
func (c *child) stop(sig syscall.Signal, grace time.Duration) {
	_ = c.stdin.Close()
	if sig != 0 {
		_ = c.cmd.Process.Signal(sig)
	}
	select {
	case <-c.exited:
	case <-time.After(grace):
		_ = c.cmd.Process.Kill()
		<-c.exited
	}
	_ = c.closeOut()
}

// alive reports whether the child still runs.
func (c *child) alive() bool {
	select {
	case <-c.exited:
		return false
	default:
		return true
	}
}
