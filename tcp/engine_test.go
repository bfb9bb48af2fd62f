package tcp

import (
	"errors"
	"flag"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// engineEnv names the engine this test binary runs its proxies on: every test in the package
// runs on the epoll engine, then TestEveryTestOnIOUring runs them all again, in a child process
// of this binary, on the io_uring engine (the engine is process-wide, like the daemon's).
const engineEnv = "KPP_TCP_TEST_ENGINE"

func TestMain(m *testing.M) {
	if os.Getenv(engineEnv) == EngineIOUring {
		e := NewIOUring(0)
		defaultEngine = e
		code := m.Run()
		e.Close()
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// requireIOURing fails (KPP_E2E_REQUIRE=1) or skips where io_uring is not available.
func requireIOURing(t *testing.T) {
	t.Helper()
	if err := ProbeIOUring(); err != nil {
		if os.Getenv("KPP_E2E_REQUIRE") == "1" {
			t.Fatalf("io_uring unavailable: %v", err)
		}
		t.Skipf("io_uring unavailable: %v", err)
	}
}

// TestEveryTestOnIOUring runs this package's tests (those -run selects) on the io_uring engine.
// With a -run filter, name it too: go test -run 'TestHalfClose|TestEveryTestOnIOUring' ./tcp/
// runs TestHalfClose on both engines.
func TestEveryTestOnIOUring(t *testing.T) {
	if os.Getenv(engineEnv) != "" {
		t.Skip("the child run itself")
	}
	requireIOURing(t)
	args := []string{"-test.skip=^TestEveryTestOnIOUring$"}
	for _, name := range []string{"test.run", "test.v", "test.count", "test.timeout", "test.short", "test.bench", "test.benchtime", "test.benchmem"} {
		if f := flag.Lookup(name); f != nil && f.Value.String() != f.DefValue {
			args = append(args, "-"+name+"="+f.Value.String())
		}
	}
	cmd := exec.CommandContext(t.Context(), os.Args[0], args...)
	cmd.Env = append(os.Environ(), engineEnv+"="+EngineIOUring)
	out, err := cmd.CombinedOutput()
	if err != nil || testing.Verbose() {
		t.Logf("the tests on the io_uring engine (%s):\n%s", strings.Join(args, " "), out)
	}
	if err != nil {
		t.Fatalf("tests on the io_uring engine: %v", err)
	}
}

func TestChooseEngine(t *testing.T) {
	blocked := errors.New("io_uring_setup: operation not permitted")
	for _, tt := range []struct {
		name      string
		flag      string
		probe     error
		want      string
		fallback  error
		wantError bool
	}{
		{"auto_takes_io_uring_when_the_probe_passes", "auto", nil, EngineIOUring, nil, false},
		{"auto_falls_back_to_epoll_with_the_reason", "auto", blocked, EngineEpoll, blocked, false},
		{"empty_is_auto", "", blocked, EngineEpoll, blocked, false},
		{"epoll_does_not_probe", "epoll", blocked, EngineEpoll, nil, false},
		{"io_uring_asked_by_name", "io_uring", nil, EngineIOUring, nil, false},
		{"io_uring_asked_by_name_fails_without_it", "io_uring", blocked, "", nil, true},
		{"unknown_name", "uring", nil, "", nil, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			probed := false
			e, fallback, err := ChooseEngine(tt.flag, func() error { probed = true; return tt.probe }, nil)
			if (err != nil) != tt.wantError {
				t.Fatalf("ChooseEngine(%q) error %v, want error %v", tt.flag, err, tt.wantError)
			}
			if err != nil {
				if tt.probe != nil && !errors.Is(err, tt.probe) {
					t.Errorf("error %v does not wrap the probe's %v", err, tt.probe)
				}
				return
			}
			defer e.Close()
			if e.Name() != tt.want || fallback != tt.fallback {
				t.Errorf("ChooseEngine(%q) = %s, fallback %v; want %s, %v", tt.flag, e.Name(), fallback, tt.want, tt.fallback)
			}
			if tt.flag == EngineEpoll && probed {
				t.Error("--io-engine=epoll probed io_uring")
			}
		})
	}
}

// TestProbeIOUringHere: this machine's kernel (6.x, io_uring enabled) passes the probe; the
// fallback on machines where it does not is TestChooseEngine's.
func TestProbeIOUringHere(t *testing.T) {
	requireIOURing(t)
}
