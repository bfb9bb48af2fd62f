// Package child runs a process for the demo and the tests (the proxy, etcd, kube-apiserver): its
// output appended to a log file, its exit owned by one goroutine and visible to any number of
// readers, its death tied to ours, its readiness polled with a deadline, and its stop a SIGTERM
// with a grace period before SIGKILL.
package child

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// Process is a started command whose exit value has exactly one owner: the goroutine that waits
// for it stores the error and then closes done, so any number of readers (a readiness wait, the
// checks, the shutdown) can see whether and how it exited without taking the value from each
// other. (Reading the exit value from a channel in a readiness poll once left the shutdown
// waiting for a value that had already been consumed, so a proxy that failed at once hung the
// demo for ever.)
type Process struct {
	Name    string // for messages: "proxy", "etcd"
	LogPath string
	Cmd     *exec.Cmd

	done chan struct{}
	err  error // the exit error; read only after done is closed
}

// Start starts cmd with its stdout and stderr appended to logPath; name is for messages. The
// child dies with this process: if it dies without stopping the child (a go test timeout, a
// SIGKILL), the kernel kills the child (Pdeathsig).
//
// Pdeathsig fires when the *thread* that forked exits, and Go ends a thread whose locked goroutine
// returns without unlocking - which network namespace code does on purpose - so the fork happens
// on a locked thread that stays alive, and unshared, until the child has exited.
func Start(name string, cmd *exec.Cmd, logPath string) (*Process, error) {
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: open log: %w", name, err)
	}
	// The child holds its own copy of the descriptor once started.
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	p := &Process{Name: name, LogPath: logPath, Cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		p.err = cmd.Wait()
		close(p.done)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("%s: start %s: %w", name, strings.Join(cmd.Args, " "), err)
	}
	return p, nil
}

// Pid is the child's process ID.
func (p *Process) Pid() int { return p.Cmd.Process.Pid }

// Done is closed once the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Err is what waiting for the process returned (nil for a clean exit), or nil while it runs.
func (p *Process) Err() error {
	if !p.Exited() {
		return nil
	}
	return p.err
}

// tailLines is how many lines of the log an error quotes.
const tailLines = 15

// ExitError describes how the process ended, with the last lines of its log. Call it only after
// Done is closed.
func (p *Process) ExitError() error {
	status := "exit status 0"
	if p.err != nil {
		status = p.err.Error()
	}
	return fmt.Errorf("%s exited early (%s); last lines of %s:\n%s", p.Name, status, p.LogPath, p.LogTail(tailLines))
}

// Annotate adds the process's exit to err when the process has exited: a failed request then
// names its real cause.
func (p *Process) Annotate(err error) error {
	if err == nil || !p.Exited() {
		return err
	}
	return errors.Join(err, p.ExitError())
}

// WaitReady polls ready every interval until it returns nil, the process exits (reported at once,
// with its exit status and log tail), ctx ends or timeout passes.
func (p *Process) WaitReady(ctx context.Context, timeout, interval time.Duration, ready func(context.Context) error) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		if p.Exited() {
			return p.ExitError()
		}
		err := ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return p.ExitError()
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w (last probe: %v); last lines of %s:\n%s", p.Name, ctx.Err(), err, p.LogPath, p.LogTail(tailLines))
		case <-deadline.C:
			return fmt.Errorf("%s not ready after %v: %w; last lines of %s:\n%s", p.Name, timeout, err, p.LogPath, p.LogTail(tailLines))
		case <-tick.C:
		}
	}
}

// Stop sends SIGTERM and waits up to grace for the process to exit, then kills it and waits up to
// grace again. It returns an error when the process had to be killed, would not die, or exited
// with a failure after SIGTERM (wrapping the *exec.ExitError, so a caller whose child dies of the
// signal itself can tell). A process that had exited before Stop is not an error here: whoever
// saw it reported it.
func (p *Process) Stop(grace time.Duration) error {
	if p.Exited() {
		return nil
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
		if p.err != nil {
			return fmt.Errorf("%s: stop: %w; last lines of %s:\n%s", p.Name, p.err, p.LogPath, p.LogTail(tailLines))
		}
		return nil
	case <-t.C:
	}
	_ = p.Cmd.Process.Kill()
	// A SIGKILLed process always dies, but on a loaded machine reaping it can take longer than a
	// short grace: the bound here only guards against a process stuck in the kernel.
	killWait := max(grace, 10*time.Second)
	t.Reset(killWait)
	select {
	case <-p.done:
		return fmt.Errorf("%s: did not exit within %v of SIGTERM; killed", p.Name, grace)
	case <-t.C:
		return fmt.Errorf("%s: pid %d still running %v after SIGKILL", p.Name, p.Pid(), killWait)
	}
}

// Kill sends SIGKILL and waits for the exit: the process gets no chance to clean anything up.
func (p *Process) Kill() {
	_ = p.Cmd.Process.Kill()
	<-p.done
}

// LogTail returns the last n lines of the log, indented, or why it cannot.
func (p *Process) LogTail(n int) string {
	f, err := os.Open(p.LogPath)
	if err != nil {
		return "  (" + err.Error() + ")"
	}
	defer f.Close()
	// The tail lives in the last few KiB; a long-running proxy's log can be large.
	window := int64(max(16<<10, n*512))
	if fi, err := f.Stat(); err == nil && fi.Size() > window {
		_, _ = f.Seek(fi.Size()-window, io.SeekStart)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return "  (" + err.Error() + ")"
	}
	lines := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	if len(lines) == 1 && lines[0] == "" {
		return "  (empty)"
	}
	return "  " + strings.Join(lines, "\n  ")
}
