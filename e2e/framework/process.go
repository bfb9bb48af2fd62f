package framework

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// process is one control plane daemon. It owns the goroutine that waits for the child to exit;
// that goroutine ends when the child does, which stop guarantees.
type process struct {
	name    string
	logPath string
	cmd     *exec.Cmd
	*Child
}

// startProcess runs bin with args and env, stdout and stderr going to logPath.
func startProcess(name, logPath, bin string, args, env []string) (*process, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	// The child has its own copy of the descriptor once started.
	defer logFile.Close()

	cmd := exec.Command(bin, args...)
	cmd.Env = env
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// If the test binary dies without running its cleanups, the kernel kills the daemon too.
	child, err := StartChild(cmd)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, logPath: logPath, cmd: cmd, Child: child}
	return p, nil
}

func (p *process) pid() int { return p.cmd.Process.Pid }

// stop sends SIGTERM, and SIGKILL if the process has not exited after grace. It returns once the
// process has exited. An exit caused by our own signal is not an error.
func (p *process) stop(grace time.Duration) error {
	select {
	case <-p.Done:
		return p.exitError()
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("stop %s (pid %d): %w", p.name, p.pid(), err)
	}
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-p.Done:
		return nil
	case <-timer.C:
	}
	if err := p.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("kill %s (pid %d): %w", p.name, p.pid(), err)
	}
	<-p.Done
	return fmt.Errorf("stop %s (pid %d): still running %v after SIGTERM, killed", p.name, p.pid(), grace)
}

// exitError describes an exit that nobody asked for.
func (p *process) exitError() error {
	return fmt.Errorf("%s (pid %d) exited: %v\n%s", p.name, p.pid(), p.Err, p.logTail(30))
}

// logTail returns the last n lines of the process's log, indented, for error messages.
func (p *process) logTail(n int) string {
	data, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("    (no log: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "    --- last %d lines of %s ---\n", len(lines), p.logPath)
	for _, l := range lines {
		fmt.Fprintf(&b, "    %s\n", l)
	}
	return b.String()
}

const checkTimeout = 5 * time.Second

// waitReady polls check until it succeeds, the process exits, or ctx ends.
func (p *process) waitReady(ctx context.Context, check func(context.Context) error) error {
	ticker := time.NewTicker(100 * time.Millisecond)
	defer ticker.Stop()
	for {
		// A daemon that accepts but never answers must not hide that it has exited meanwhile.
		checkCtx, cancel := context.WithTimeout(ctx, checkTimeout)
		err := check(checkCtx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-p.Done:
			return p.exitError()
		case <-ctx.Done():
			return fmt.Errorf("%s (pid %d) not ready: %w (last check: %w)\n%s",
				p.name, p.pid(), ctx.Err(), err, p.logTail(30))
		case <-ticker.C:
		}
	}
}

// Child is a process started by StartChild.
type Child struct {
	Done chan struct{} // closed once the process has exited; Err is set then
	Err  error         // what cmd.Wait returned
}

// StartChild starts cmd so that it dies with the test binary: if the test process dies without
// running its cleanups (a go test timeout, a SIGKILL), the kernel kills the child (Pdeathsig).
// Pdeathsig fires when the *thread* that forked exits, and Go ends a thread whose locked goroutine
// returns without unlocking - which network namespace code does on purpose - so the fork happens
// on a locked thread that stays alive, and unshared, until the child has exited.
func StartChild(cmd *exec.Cmd) (*Child, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	c := &Child{Done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		c.Err = cmd.Wait()
		close(c.Done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return c, nil
}
