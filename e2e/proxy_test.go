package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// Addresses the proxy serves health and metrics on, on the node namespace's own loopback.
const (
	healthzAddr = "127.0.0.1:10256"
	metricsAddr = "127.0.0.1:10249"
)

// proxyProcess is the real binary running in a namespace (`ip netns exec` execs it, so the
// child's PID is the proxy's). It owns the goroutine that waits for the child.
type proxyProcess struct {
	cmd     *exec.Cmd
	logPath string
	*framework.Child
}

// startProxy runs the proxy binary in ns with args, logging to a file in dir. The test's cleanup
// stops it (SIGTERM, then SIGKILL) and, when the test failed, prints the end of its log.
func startProxy(t *testing.T, ns *netns.NS, dir string, args ...string) *proxyProcess {
	t.Helper()
	logFile, err := os.CreateTemp(dir, "proxy-*.log")
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close() // the child has its own descriptor
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns.Name, proxyBinary}, args...)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// If the test binary dies without its cleanups, the kernel kills the proxy too.
	child, err := framework.StartChild(cmd)
	if err != nil {
		t.Fatalf("start %s in %s: %v", proxyBinary, ns.Name, err)
	}
	p := &proxyProcess{cmd: cmd, logPath: logFile.Name(), Child: child}
	t.Logf("proxy pid %d in %s: %s", cmd.Process.Pid, ns.Name, strings.Join(args, " "))
	t.Cleanup(func() {
		if err := p.stop(); err != nil {
			t.Errorf("stop proxy: %v", err)
		}
		if t.Failed() {
			t.Logf("proxy log %s (last 60 lines):\n%s", p.logPath, p.logTail(60))
		}
	})
	return p
}

// exited returns an error describing the exit if the proxy is no longer running, or nil.
func (p *proxyProcess) exited() error {
	select {
	case <-p.Done:
		return fmt.Errorf("proxy exited: %v; log:\n%s", p.Err, p.logTail(30))
	default:
		return nil
	}
}

// kill sends SIGKILL and waits for the exit: the proxy gets no chance to clean anything up.
func (p *proxyProcess) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.Done
}

// stop sends SIGTERM and waits for a clean exit, killing the proxy after a grace period. It is
// an error if the proxy had already died on its own or needed SIGKILL.
func (p *proxyProcess) stop() error {
	select {
	case <-p.Done:
		return nil // already stopped (or killed) by the test
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	select {
	case <-p.Done:
		if p.Err != nil {
			return fmt.Errorf("exit after SIGTERM: %w", p.Err)
		}
		return nil
	case <-time.After(20 * time.Second):
		p.kill()
		return errors.New("no exit 20s after SIGTERM; killed")
	}
}

func (p *proxyProcess) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return err.Error()
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// runProxyOnce runs the binary in ns to completion (e.g. --cleanup) and returns its output.
func runProxyOnce(t *testing.T, ns *netns.NS, args ...string) (string, error) {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "ip", append([]string{"netns", "exec", ns.Name, proxyBinary}, args...)...).CombinedOutput()
	return string(out), err
}

// proxyArgs are the flags every scenario passes: health and metrics on the node's loopback and
// a short minimum sync period, so changes show within a fraction of a second.
func proxyArgs(extra ...string) []string {
	return append([]string{
		"--healthz-bind-address=" + healthzAddr,
		"--metrics-bind-address=" + metricsAddr,
		"--iptables-min-sync-period=200ms",
		// Leave conntrack sysctls alone: the node namespace's are harmless, but on older kernels
		// nf_conntrack_max is shared with the whole host.
		"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
	}, extra...)
}
