package framework

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/child"
)

// process is one control plane daemon, run by internal/child: its exit has one owner, and it dies
// with the test binary.
type process struct{ *child.Process }

// startProcess runs bin with args and env, stdout and stderr going to logPath.
func startProcess(name, logPath, bin string, args, env []string) (*process, error) {
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	p, err := child.Start(name, cmd, logPath)
	if err != nil {
		return nil, err
	}
	return &process{p}, nil
}

func (p *process) pid() int { return p.Pid() }

// stop sends SIGTERM, and SIGKILL if the process has not exited after grace. It returns once the
// process has exited. A daemon that had exited on its own is an error; an exit caused by our own
// signal is not.
func (p *process) stop(grace time.Duration) error {
	if p.Exited() {
		return p.ExitError()
	}
	err := p.Stop(grace)
	if exit := (*exec.ExitError)(nil); errors.As(err, &exit) {
		return nil
	}
	return err
}

// logTail returns the last n lines of the process's log under a heading, for error messages
// that quote several logs.
func (p *process) logTail(n int) string {
	return fmt.Sprintf("    --- last %d lines of %s ---\n%s\n", n, p.LogPath, p.LogTail(n))
}

// checkTimeout bounds one readiness check: a daemon that accepts but never answers must not hide
// that it has exited meanwhile.
const checkTimeout = 5 * time.Second

// waitReady polls check until it succeeds, the process exits, or ctx ends.
func (p *process) waitReady(ctx context.Context, check func(context.Context) error) error {
	return p.WaitReady(ctx, DefaultStartTimeout, 100*time.Millisecond, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, checkTimeout)
		defer cancel()
		return check(ctx)
	})
}
