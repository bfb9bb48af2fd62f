package child

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The tests start this test binary again as the process under test; envHelper picks its part.
const envHelper = "KPP_CHILD_TEST_HELPER"

func TestMain(m *testing.M) {
	if h := os.Getenv(envHelper); h != "" {
		helper(h)
		return
	}
	os.Exit(m.Run())
}

// helper plays a proxy: each part writes "ready" to its log once its signal handling is in place,
// so a test can wait for that instead of sleeping.
func helper(part string) {
	switch part {
	case "exit-at-once":
		fmt.Println("level=error msg=Exiting error=\"iptables not found in PATH\"")
		os.Exit(3)
	case "term-exits-0", "term-exits-1":
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
		defer stop()
		fmt.Println("ready")
		<-ctx.Done()
		fmt.Println("cleanup failed")
		if part == "term-exits-1" {
			os.Exit(1)
		}
		os.Exit(0)
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
		fmt.Println("ready")
		// Not select{}: with no other goroutine the runtime may call that a deadlock and exit,
		// which is not the process that ignores SIGTERM this case needs.
		for {
			time.Sleep(time.Hour)
		}
	}
	os.Exit(99)
}

// startHelper starts the helper part with its log in a temp dir and kills it at cleanup.
func startHelper(t *testing.T, part string) *Process {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), envHelper+"="+part)
	p, err := Start("proxy", cmd, filepath.Join(t.TempDir(), "proxy.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// logSays is a readiness probe: the log contains s.
func logSays(p *Process, s string) func(context.Context) error {
	return func(context.Context) error {
		b, err := os.ReadFile(p.LogPath)
		if err != nil {
			return err
		}
		if !strings.Contains(string(b), s) {
			return fmt.Errorf("log has no %q yet", s)
		}
		return nil
	}
}

// within fails t unless f returns within d; it returns f's error.
func within(t *testing.T, d time.Duration, what string, f func() error) error {
	t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- f() }()
	select {
	case err := <-errc:
		return err
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
		return nil
	}
}

func TestWaitReady(t *testing.T) {
	refused := func(context.Context) error { return errors.New("connection refused") }
	tests := []struct {
		name    string
		part    string
		ready   func(p *Process) func(context.Context) error
		timeout time.Duration
		want    []string // substrings of the error; nil means no error
	}{
		{
			name:    "proxy_that_exits_at_once_is_reported_with_status_and_log",
			part:    "exit-at-once",
			ready:   func(*Process) func(context.Context) error { return refused },
			timeout: time.Minute,
			want:    []string{"proxy exited early", "exit status 3", "iptables not found in PATH", "proxy.log"},
		},
		{
			name:    "ready_proxy",
			part:    "term-exits-0",
			ready:   func(p *Process) func(context.Context) error { return logSays(p, "ready") },
			timeout: time.Minute,
		},
		{
			name:    "proxy_never_ready_times_out_with_last_probe_and_log",
			part:    "term-exits-0",
			ready:   func(*Process) func(context.Context) error { return refused },
			timeout: 200 * time.Millisecond,
			want:    []string{"proxy not ready after 200ms", "connection refused", "proxy.log"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startHelper(t, tt.part)
			err := within(t, 20*time.Second, "waitReady", func() error {
				return p.WaitReady(t.Context(), tt.timeout, 10*time.Millisecond, tt.ready(p))
			})
			if tt.want == nil {
				if err != nil {
					t.Fatalf("waitReady: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("waitReady: no error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not mention %q:\n%v", w, err)
				}
			}
		})
	}
}

// The bug this guards against: the readiness wait saw the early exit, and then the shutdown
// waited for ever for an exit value that had already been taken.
func TestStopAfterEarlyExitReturns(t *testing.T) {
	p := startHelper(t, "exit-at-once")
	err := within(t, 20*time.Second, "waitReady", func() error {
		return p.WaitReady(t.Context(), time.Minute, 10*time.Millisecond, func(context.Context) error { return errors.New("refused") })
	})
	if err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("waitReady = %v, want the exit status", err)
	}
	if err := within(t, 5*time.Second, "stop", func() error { return p.Stop(time.Minute) }); err != nil {
		t.Errorf("stop after an exit already reported: %v, want nil", err)
	}
	// Every reader still sees the exit.
	if !p.Exited() || !strings.Contains(p.Annotate(errors.New("request failed")).Error(), "exit status 3") {
		t.Errorf("annotate after exit = %v, want the exit status", p.Annotate(errors.New("request failed")))
	}
}

func TestStop(t *testing.T) {
	tests := []struct {
		name  string
		part  string
		grace time.Duration
		want  []string // substrings of the error; nil means no error
	}{
		{name: "sigterm_clean_exit", part: "term-exits-0", grace: time.Minute},
		{name: "sigterm_failed_exit_is_reported_with_log", part: "term-exits-1", grace: time.Minute,
			want: []string{"proxy: stop", "exit status 1", "cleanup failed"}},
		{name: "ignores_sigterm_is_killed_after_grace", part: "ignore-term", grace: 300 * time.Millisecond,
			want: []string{"did not exit within 300ms of SIGTERM; killed"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startHelper(t, tt.part)
			if err := p.WaitReady(t.Context(), 20*time.Second, 10*time.Millisecond, logSays(p, "ready")); err != nil {
				t.Fatal(err)
			}
			err := within(t, 20*time.Second, "stop", func() error { return p.Stop(tt.grace) })
			if !p.Exited() {
				t.Error("stop returned with the process still running")
			}
			if tt.want == nil {
				if err != nil {
					t.Fatalf("stop: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("stop: no error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not mention %q:\n%v", w, err)
				}
			}
		})
	}
}

func TestLogTail(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) *Process {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return &Process{LogPath: path}
	}
	var long, last strings.Builder
	for i := 1; i <= 100; i++ {
		fmt.Fprintf(&long, "line %d\n", i)
		if i > 100-tailLines {
			fmt.Fprintf(&last, "\n  line %d", i)
		}
	}
	tests := []struct {
		name string
		p    *Process
		want string
	}{
		{"empty_log", write("empty", ""), "  (empty)"},
		{"short_log_whole", write("short", "a\nb\n"), "  a\n  b"},
		{"long_log_last_lines", write("long", long.String()), last.String()[1:]},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.p.LogTail(tailLines); got != tt.want {
				t.Errorf("logTail() = %q, want %q", got, tt.want)
			}
		})
	}
	t.Run("missing_log_says_why", func(t *testing.T) {
		p := &Process{LogPath: filepath.Join(dir, "nope")}
		if got := p.LogTail(tailLines); !strings.Contains(got, "no such file") {
			t.Errorf("logTail() = %q, want the open error", got)
		}
	})
}
