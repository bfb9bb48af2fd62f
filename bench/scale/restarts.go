package main

// restarts.go: what a client sees across restarts, run -restart-runs times in a row on a loaded
// proxy: SIGKILL and an immediate restart (restartWindow), and with -planned a planned restart
// (a successor started with --handover-socket, SIGTERM to the old process plannedAfter later),
// each optionally beside -hog (one busy loop per CPU at normal priority, for the measurement
// only). The client of a planned restart opens a connection every plannedEvery and gives up on
// one whose greeting takes over a second.

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// restartOptions are -restart-runs, -planned and -hog.
type restartOptions struct {
	runs    int
	planned bool
	hog     time.Duration // 0: no hog
	// handoverSocket is the --handover-socket both processes of a planned restart get.
	handoverSocket string
}

const (
	plannedEvery    = 5 * time.Millisecond
	plannedDeadline = time.Second
	plannedAfter    = 15 * time.Second
)

// warmFor is how long the client uses the probed service before the first restart.
const warmFor = 7 * time.Second

// useFor has the client connect to addr every 50 ms for d.
func useFor(ctx context.Context, bed *testbed.Bed, addr netip.AddrPort, d time.Duration) error {
	for t0 := time.Now(); time.Since(t0) < d; {
		if _, err := testbed.Who(bed.Client, addr, 2*time.Second); err != nil {
			return err
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// startHog starts one busy loop per CPU, each ending by itself after d; stop ends them at once.
func startHog(d time.Duration) (stop func(), err error) {
	if d <= 0 {
		return func() {}, nil
	}
	var cmds []*exec.Cmd
	stop = func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}
	// One process per loop, the loop itself bounded (a shell's SECONDS): killing it ends it,
	// with no child left behind (a `timeout` killed with SIGKILL leaves its child running).
	loop := fmt.Sprintf("end=$((SECONDS+%d)); while [ $SECONDS -lt $end ]; do :; done", int(d.Seconds())+1)
	for range runtime.NumCPU() {
		c := exec.Command("bash", "-c", loop)
		if err := c.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("hog: %w", err)
		}
		cmds = append(cmds, c)
	}
	return stop, nil
}

// plannedResult is what the client saw across one planned restart.
type plannedResult struct {
	attempts, failed int           // failed: no greeting within plannedDeadline
	longestGap       time.Duration // between two answers
	oldExit          time.Duration // from the successor's start until the old process exited
	failures         []string      // the first few failures: when (from the successor's start) and why
}

// plannedRestart starts a successor beside old, SIGTERMs old plannedAfter later, and has a client
// connect to addr every plannedEvery from 0.5 s before the successor's start until 1 s after the
// old process exited (at most 2 minutes). It returns the successor.
func plannedRestart(ctx context.Context, bed *testbed.Bed, addr netip.AddrPort, old *exec.Cmd, start func() (*exec.Cmd, *logWatch, error)) (plannedResult, *exec.Cmd, error) {
	var r plannedResult
	var t0 time.Time // the successor's start; set before the client can fail after it
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	wg.Go(func() {
		tick := time.NewTicker(plannedEvery)
		defer tick.Stop()
		last := time.Now()
		for {
			select {
			case <-stop:
				return
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			_, err := testbed.Who(bed.Client, addr, plannedDeadline)
			now := time.Now()
			mu.Lock()
			r.attempts++
			if err != nil {
				r.failed++
				if len(r.failures) < 5 {
					r.failures = append(r.failures, fmt.Sprintf("%v: %v", now.Sub(t0).Round(time.Millisecond), err))
				}
			} else {
				r.longestGap = max(r.longestGap, now.Sub(last))
				last = now
			}
			mu.Unlock()
		}
	})
	finish := func() { close(stop); wg.Wait() }
	if err := sleepCtx(ctx, 500*time.Millisecond); err != nil {
		finish()
		return r, nil, err
	}
	mu.Lock()
	t0 = time.Now()
	mu.Unlock()
	next, _, err := start()
	if err != nil {
		finish()
		return r, nil, err
	}
	exited := make(chan struct{})
	go func() { _ = old.Wait(); close(exited) }()
	if err := sleepCtx(ctx, plannedAfter); err != nil {
		finish()
		return r, next, err
	}
	_ = old.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(2 * time.Minute):
		_ = old.Process.Kill()
		<-exited
	case <-ctx.Done():
	}
	r.oldExit = time.Since(t0)
	err = sleepCtx(ctx, time.Second)
	finish()
	return r, next, err
}

// sleepCtx waits d (pacing a measurement, not synchronising) or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// waitSnapshotSince waits until the restart snapshot was written after t: the process started at t
// has synced and saved what it serves.
func waitSnapshotSince(ctx context.Context, path string, t time.Time) error {
	return testbed.Eventually(ctx, 2*time.Minute, 50*time.Millisecond, func() error {
		st, err := os.Stat(path)
		if err != nil {
			return err
		}
		if !st.ModTime().After(t) {
			return errors.New("restart snapshot not written since the start")
		}
		return nil
	})
}

// restartRuns runs o.runs SIGKILL restarts, then o.runs planned ones (-planned), each with the
// hog on, printing each result; cur is the running proxy, start starts another with the same
// flags (and watches its log for the serving line), ready waits until a process started at t serves everything (and has written its
// snapshot). It returns the proxy running at the end.
func restartRuns(ctx context.Context, bed *testbed.Bed, addr netip.AddrPort, o restartOptions, cur *exec.Cmd,
	start func() (*exec.Cmd, *logWatch, error), ready func(t time.Time) error) (*exec.Cmd, error) {
	hogged := func(f func() error) error {
		stopHog, err := startHog(o.hog)
		if err != nil {
			return err
		}
		defer stopHog()
		return f()
	}
	fmt.Printf("restarts: load average %s; hog: %v\n", loadavg(), o.hog)
	// A node's clients were using the service before the crash: the client uses it for a few
	// seconds first, long enough for a proxy that records activity in its restart snapshot
	// (every 5 s) to have it there, as on a node in use. Every build gets the same.
	if err := useFor(ctx, bed, addr, warmFor); err != nil {
		return cur, fmt.Errorf("before the restarts: %w", err)
	}
	for i := range o.runs {
		var w window
		var startedAt time.Time
		ev, err := startEvidence(ctx, bed, i+1)
		if err != nil {
			return cur, err
		}
		err = hogged(func() (err error) {
			w, err = restartWindow(ctx, bed, func(s *split) error {
				_ = cur.Process.Kill()
				_ = cur.Wait()
				s.reaped = time.Now()
				startedAt = s.reaped
				var next *exec.Cmd
				next, s.serving, err = start()
				s.started = time.Now()
				if next != nil {
					cur = next
				}
				if err != nil {
					return err
				}
				// The client goes on connecting through the restarted process's first sync.
				settled := make(chan error, 1)
				s.settled = settled
				go func() { settled <- ready(startedAt) }()
				return nil
			}, addr)
			return err
		})
		err = errors.Join(err, ev.finish(bed))
		if err != nil {
			return cur, fmt.Errorf("SIGKILL run %d: %w", i+1, err)
		}
		fmt.Printf("SIGKILL run %d (load %s): kill -> first answer %v; last answer before -> first after %v; %d of %d failed\n%s",
			i+1, loadavg(), w.recovered.Round(time.Millisecond), w.gap.Round(time.Millisecond), w.failed, w.attempts, w.split)
	}
	if !o.planned {
		return cur, nil
	}
	for i := range o.runs {
		var p plannedResult
		var startedAt time.Time
		err := hogged(func() error {
			var next *exec.Cmd
			var err error
			p, next, err = plannedRestart(ctx, bed, addr, cur, func() (*exec.Cmd, *logWatch, error) { startedAt = time.Now(); return start() })
			if next != nil {
				cur = next
			}
			return err
		})
		if err != nil {
			return cur, fmt.Errorf("planned run %d: %w", i+1, err)
		}
		fmt.Printf("planned run %d (load %s): %d of %d connections without a greeting within %v; longest gap between answers %v; old process exited %v after the successor's start\n",
			i+1, loadavg(), p.failed, p.attempts, plannedDeadline, p.longestGap.Round(time.Millisecond), p.oldExit.Round(time.Millisecond))
		for _, f := range p.failures {
			fmt.Printf("  failed at %s\n", f)
		}
		if err := ready(startedAt); err != nil {
			return cur, err
		}
	}
	return cur, nil
}
