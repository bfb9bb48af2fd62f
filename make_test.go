package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// The Make targets a user runs by hand on the real-cluster path, the bench and the soak must fail
// (or install what is missing) in seconds, before any build: a fresh machine once built for 23
// minutes before stopping at a missing mmdebstrap (issue #41). These tests run those targets on
// a copy of the Makefile and hack/ in a throwaway mount namespace where the tools are hidden
// (/dev/null bound over each one present, which is not executable), so the machine's own
// packages are never touched.

// firstErrorWithin is the promise: the time to the first error for a missing tool.
const firstErrorWithin = 10 * time.Second

// buildMarks are lines a started build prints (the recipes make echoes): none may appear.
var buildMarks = []string{"go build", "controlplane-build.sh", "cluster/build.sh", "conformance/build.sh", "oci/image.sh", "bench/suite"}

// hiddenTools are what the cluster, image and bench groups of hack/install-deps.sh look for that
// a test hides: at least one from each group.
var hiddenTools = []string{"mmdebstrap", "containerd", "runc", "/usr/lib/cni/bridge", "haproxy"}

type makeRun struct {
	out     string
	err     error
	elapsed time.Duration
}

// preflightBed is a copy of the Makefile and hack/ in a directory any user can read, and the
// paths of the hidden tools that exist on this machine.
type preflightBed struct {
	dir, fakebin, aptLog string
	hide                 []string
}

func newPreflightBed(t *testing.T) *preflightBed {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Unavailable(t, "needs root (a mount namespace, and a user to drop to)")
	}
	for _, tool := range []string{"make", "unshare", "setpriv", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Unavailable(t, "%s not found", tool)
		}
	}
	// Not t.TempDir: its parent is private to root, and the copy must be readable by nobody.
	dir, err := os.MkdirTemp("", "kpp-preflight-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cp := exec.Command("cp", "-a", "Makefile", "hack", dir)
	if out, err := cp.CombinedOutput(); err != nil {
		t.Fatalf("copy the Makefile and hack/: %v: %s", err, out)
	}
	b := &preflightBed{dir: dir, fakebin: filepath.Join(dir, "fakebin"), aptLog: filepath.Join(dir, "apt-get.log")}
	// A fake apt-get first on PATH records what it was asked and installs nothing, so the
	// install step is seen without changing the machine.
	if err := os.Mkdir(b.fakebin, 0o755); err != nil {
		t.Fatal(err)
	}
	fake := "#!/bin/sh\necho \"$*\" >>" + b.aptLog + "\n"
	if err := os.WriteFile(filepath.Join(b.fakebin, "apt-get"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tool := range hiddenTools {
		for _, p := range toolPaths(tool) {
			b.hide = append(b.hide, p)
		}
	}
	return b
}

// toolPaths lists where a tool is installed: every executable of that name on PATH and in the
// sbin directories install-deps.sh also looks in, or the absolute path itself.
func toolPaths(tool string) []string {
	var cands []string
	if filepath.IsAbs(tool) {
		cands = []string{tool}
	} else {
		for _, d := range append(filepath.SplitList(os.Getenv("PATH")), "/usr/sbin", "/sbin", "/usr/bin", "/bin", "/usr/local/bin") {
			cands = append(cands, filepath.Join(d, tool))
		}
	}
	var out []string
	seen := map[string]bool{}
	for _, c := range cands {
		real, err := filepath.EvalSymlinks(c)
		if err != nil || seen[real] {
			continue
		}
		if fi, err := os.Stat(real); err == nil && fi.Mode().IsRegular() {
			seen[real] = true
			out = append(out, real)
		}
	}
	return out
}

// run runs make TARGET in the bed's copy, in a new mount namespace with the tools hidden, as
// root with the fake apt-get, or as nobody. It gives up after a minute (a build that started).
func (b *preflightBed) run(t *testing.T, asRoot bool, target string, env ...string) makeRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	script := `for f in "$@"; do [ "$f" = -- ] && break; mount --bind /dev/null "$f" || exit 99; done
while [ "$1" != -- ]; do shift; done; shift; exec "$@"`
	args := []string{"-m", "sh", "-c", script, "sh"}
	args = append(args, b.hide...)
	args = append(args, "--")
	if !asRoot {
		args = append(args, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
	}
	args = append(args, "make", "--no-print-directory", "-C", b.dir, target)
	cmd := exec.CommandContext(ctx, "unshare", args...)
	// Its own process group, killed whole at the deadline: a started build must not outlive it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/usr/local/go/bin"
	if asRoot {
		path = b.fakebin + ":" + path
	}
	cmd.Env = append([]string{"PATH=" + path, "HOME=" + b.dir, "LANG=C"}, env...)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	r := makeRun{out: string(out), err: err, elapsed: time.Since(start)}
	if ctx.Err() != nil {
		t.Fatalf("make %s still ran after a minute (a build started?):\n%s", target, out)
	}
	if strings.Contains(r.out, "mount: ") {
		t.Fatalf("hiding the tools failed:\n%s", out)
	}
	return r
}

// check asserts that a run failed within the promise, printed each of want, and built nothing.
func (r makeRun) check(t *testing.T, target string, want ...string) {
	t.Helper()
	if r.err == nil {
		t.Errorf("make %s succeeded, want a failure:\n%s", target, r.out)
	}
	if r.elapsed > firstErrorWithin {
		t.Errorf("make %s took %v to its first error, want under %v", target, r.elapsed, firstErrorWithin)
	}
	for _, w := range want {
		if !strings.Contains(r.out, w) {
			t.Errorf("make %s output lacks %q:\n%s", target, w, r.out)
		}
	}
	for _, m := range buildMarks {
		if strings.Contains(r.out, m) {
			t.Errorf("make %s started a build (%q) before its preflight failed:\n%s", target, m, r.out)
		}
	}
}

// TestHandRunTargetsNameMissingToolsAtOnce: without root, every target of the real-cluster
// path, the image, the bench and the soak stops at once naming what is missing and the command
// that installs it, or, with nothing missing, that it needs root.
func TestHandRunTargetsNameMissingToolsAtOnce(t *testing.T) {
	b := newPreflightBed(t)
	for _, tt := range []struct {
		target string
		want   []string
	}{
		{"cluster", []string{"missing: ", "mmdebstrap", "containerd", "apt-get install -y", "containernetworking-plugins"}},
		{"conformance", []string{"missing: ", "mmdebstrap", "containerd"}},
		{"conformance-ci", []string{"missing: ", "mmdebstrap", "runc"}},
		{"cluster-test", []string{"missing: ", "containerd"}},
		{"cluster-build", []string{"missing: ", "containerd"}},
		{"image-oci", []string{"missing: mmdebstrap", "apt-get install -y mmdebstrap"}},
		{"bench", []string{"missing: ", "haproxy"}},
		{"bench-quick", []string{"missing: ", "haproxy"}},
	} {
		t.Run(tt.target, func(t *testing.T) {
			b.run(t, false, tt.target).check(t, tt.target, tt.want...)
		})
	}
}

// TestHandRunTargetsInstallFirst: as root, the same targets run the install (apt-get with the
// group's packages) before anything else; the fake apt-get installs nothing, so each then stops,
// naming what is still missing, again before any build.
func TestHandRunTargetsInstallFirst(t *testing.T) {
	b := newPreflightBed(t)
	for _, tt := range []struct {
		target   string
		packages []string
	}{
		{"cluster", []string{"mmdebstrap", "containerd", "runc", "containernetworking-plugins"}},
		{"conformance", []string{"mmdebstrap", "containerd"}},
		{"image-oci", []string{"mmdebstrap"}},
		{"bench", []string{"haproxy"}},
	} {
		t.Run(tt.target, func(t *testing.T) {
			os.Remove(b.aptLog)
			b.run(t, true, tt.target).check(t, tt.target, "still missing: ")
			log, err := os.ReadFile(b.aptLog)
			if err != nil {
				t.Fatalf("make %s did not run apt-get: %v", tt.target, err)
			}
			var install string
			for _, line := range strings.Split(string(log), "\n") {
				if strings.HasPrefix(line, "install ") {
					install = line
				}
			}
			for _, p := range tt.packages {
				if !strings.Contains(" "+install+" ", " "+p+" ") {
					t.Errorf("make %s: apt-get install %q lacks %s (apt-get log:\n%s)", tt.target, install, p, log)
				}
			}
		})
	}
}

// TestClusterStepsNeedARunningCluster: the steps that work on a running cluster say so at once
// when none is up (conformance starts one itself, see above: it first needs the cluster group).
func TestClusterStepsNeedARunningCluster(t *testing.T) {
	b := newPreflightBed(t)
	b.hide = nil // the tools are not what these steps check first
	for _, target := range []string{"cluster-smoke", "cluster-swap", "cluster-rollout"} {
		t.Run(target, func(t *testing.T) {
			b.run(t, true, target, "KPP_CLUSTER_NETNS=kpp-preflight-test-none").check(t, target, "no cluster (make cluster first)")
		})
	}
}

// TestSoakNeedsRoot: with its packages present, make soak as another user stops at once.
func TestSoakNeedsRoot(t *testing.T) {
	b := newPreflightBed(t)
	b.hide = nil
	if out, err := exec.Command("hack/install-deps.sh", "--check", "test").CombinedOutput(); err != nil {
		testenv.Unavailable(t, "the test group is not installed: %s", out)
	}
	b.run(t, false, "soak").check(t, "soak", "make soak needs root")
}
