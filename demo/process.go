package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// tailLines is how many lines of the proxy's log an error quotes.
const tailLines = 15

// process is a started command whose exit value has exactly one owner: the goroutine that waits
// for it stores the error and then closes done, so any number of readers (the readiness wait, the
// checks, the shutdown) can see whether and how it exited without taking the value from each
// other. (Reading the exit value from a channel in the readiness poll once left the shutdown
// waiting for a value that had already been consumed, so a proxy that failed at once hung the
// demo for ever.)
type process struct {
	name    string // for messages: "proxy"
	cmd     *exec.Cmd
	logPath string
	done    chan struct{}
	err     error // the exit error; read only after done is closed
}

// startProcess starts argv with stdout and stderr appended to logPath. env nil means the
// caller's environment.
func startProcess(name string, argv, env []string, logPath string) (*process, error) {
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: open log: %w", name, err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = log, log
	err = cmd.Start()
	// The child holds its own copy of the descriptor.
	log.Close()
	if err != nil {
		return nil, fmt.Errorf("%s: start %s: %w", name, strings.Join(argv, " "), err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// exited reports whether the process has exited.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// exitError describes how the process ended, with the last lines of its log. Call it only after
// done is closed.
func (p *process) exitError() error {
	status := "exit status 0"
	if p.err != nil {
		status = p.err.Error()
	}
	return fmt.Errorf("%s exited early (%s); last lines of %s:\n%s", p.name, status, p.logPath, p.logTail())
}

// annotate adds the process's exit to err when the process has exited: a failed request then
// names its real cause.
func (p *process) annotate(err error) error {
	if err == nil || !p.exited() {
		return err
	}
	return errors.Join(err, p.exitError())
}

// waitReady polls ready every interval until it returns nil, the process exits (reported at once,
// with its exit status and log tail), ctx ends or timeout passes.
func (p *process) waitReady(ctx context.Context, timeout, interval time.Duration, ready func() error) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		if p.exited() {
			return p.exitError()
		}
		err := ready()
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return p.exitError()
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w (last probe: %v)", p.name, ctx.Err(), err)
		case <-deadline.C:
			return fmt.Errorf("%s not ready after %v: %w; last lines of %s:\n%s", p.name, timeout, err, p.logPath, p.logTail())
		case <-tick.C:
		}
	}
}

// stop sends SIGTERM and waits up to grace for the process to exit, then kills it and waits up to
// grace again. It returns an error when the process had to be killed, would not die, or exited
// with a failure after SIGTERM (a proxy that cannot remove its rules says so in its exit status).
// A process that had exited before stop is not an error here: whoever saw it reported it.
func (p *process) stop(grace time.Duration) error {
	if p.exited() {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
		if p.err != nil {
			return fmt.Errorf("%s: stop: %w; last lines of %s:\n%s", p.name, p.err, p.logPath, p.logTail())
		}
		return nil
	case <-t.C:
	}
	_ = p.cmd.Process.Kill()
	t.Reset(grace)
	select {
	case <-p.done:
		return fmt.Errorf("%s: did not exit within %v of SIGTERM; killed", p.name, grace)
	case <-t.C:
		return fmt.Errorf("%s: pid %d still running %v after SIGKILL", p.name, p.cmd.Process.Pid, grace)
	}
}

// logTail returns the last lines of the log, indented, or why it cannot.
func (p *process) logTail() string {
	f, err := os.Open(p.logPath)
	if err != nil {
		return "  (" + err.Error() + ")"
	}
	defer f.Close()
	// The tail lives in the last few KiB; a long-running proxy's log can be large.
	const window = 16 << 10
	if fi, err := f.Stat(); err == nil && fi.Size() > window {
		_, _ = f.Seek(fi.Size()-window, io.SeekStart)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return "  (" + err.Error() + ")"
	}
	lines := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(lines) > tailLines {
		lines = lines[len(lines)-tailLines:]
	}
	if len(lines) == 1 && lines[0] == "" {
		return "  (empty)"
	}
	return "  " + strings.Join(lines, "\n  ")
}
