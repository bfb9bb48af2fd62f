package e2e

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/child"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// Addresses the proxy serves health and metrics on, on the node namespace's own loopback.
const (
	healthzAddr = "127.0.0.1:10256"
	metricsAddr = "127.0.0.1:10249"
)

// proxyProcess is the real binary running in a namespace (`ip netns exec` execs it, so the
// child's PID is the proxy's), run by internal/child: its exit has one owner, and it dies with the
// test binary.
type proxyProcess struct{ *child.Process }

// proxyStopGrace bounds a clean exit after SIGTERM (the proxy's own shutdown timeout is 10s).
const proxyStopGrace = 20 * time.Second

// startProxy runs the proxy binary in ns with args, logging to a file in dir. The test's cleanup
// stops it (SIGTERM, then SIGKILL) and, when the test failed, prints the end of its log.
func startProxy(t *testing.T, ns *netns.NS, dir string, args ...string) *proxyProcess {
	t.Helper()
	return startProxyEnv(t, ns, dir, nil, args...)
}

// startProxyEnv is startProxy with env added to the proxy's environment (later entries win).
func startProxyEnv(t *testing.T, ns *netns.NS, dir string, env []string, args ...string) *proxyProcess {
	t.Helper()
	logFile, err := os.CreateTemp(dir, "proxy-*.log")
	if err != nil {
		t.Fatal(err)
	}
	logFile.Close()
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns.Name, proxyBinary}, args...)...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	c, err := child.Start("proxy", cmd, logFile.Name())
	if err != nil {
		t.Fatalf("start %s in %s: %v", proxyBinary, ns.Name, err)
	}
	p := &proxyProcess{c}
	t.Logf("proxy pid %d in %s: %s", p.Pid(), ns.Name, strings.Join(args, " "))
	t.Cleanup(func() {
		if err := p.stop(); err != nil {
			t.Errorf("stop proxy: %v", err)
		}
		if t.Failed() {
			t.Logf("proxy log %s (last 60 lines):\n%s", p.LogPath, p.LogTail(60))
		}
	})
	return p
}

// stop sends SIGTERM and waits for a clean exit, killing the proxy after a grace period. It is
// an error if the proxy failed after SIGTERM or needed SIGKILL (an exit seen before is reported by
// whoever saw it).
func (p *proxyProcess) stop() error { return p.Stop(proxyStopGrace) }

// waitAnswers waits until addr answers a TCP request from ns (the backend says who it is),
// failing at once, with the proxy's log, if the proxy exits meanwhile.
func (p *proxyProcess) waitAnswers(t *testing.T, from *netns.NS, addr netip.AddrPort, what string) {
	t.Helper()
	eventually(t, 30*time.Second, what, func() error {
		if err := p.exited(); err != nil {
			return err
		}
		_, err := whoTCP(from, addr)
		return err
	})
}

// exited returns an error describing the exit if the proxy is no longer running, or nil.
func (p *proxyProcess) exited() error {
	if !p.Exited() {
		return nil
	}
	return fmt.Errorf("proxy exited: %v; log:\n%s", p.Err(), p.LogTail(30))
}

// runProxyOnce runs the binary in ns to completion (e.g. --cleanup) and returns its output.
func runProxyOnce(t *testing.T, ns *netns.NS, args ...string) (string, error) {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), "ip", append([]string{"netns", "exec", ns.Name, proxyBinary}, args...)...).CombinedOutput()
	return string(out), err
}

// proxyArgs are the flags every scenario passes: health and metrics on the node's loopback and
// a short minimum sync period, so changes show within a fraction of a second; and
// --io-engine=$KPP_E2E_IO_ENGINE when set (make e2e-epoll runs the suite on the epoll engine).
func proxyArgs(extra ...string) []string {
	if e := os.Getenv("KPP_E2E_IO_ENGINE"); e != "" {
		extra = append([]string{"--io-engine=" + e}, extra...)
	}
	return append([]string{
		"--healthz-bind-address=" + healthzAddr,
		"--metrics-bind-address=" + metricsAddr,
		"--iptables-min-sync-period=200ms",
		// Leave conntrack sysctls alone: the node namespace's are harmless, but on older kernels
		// nf_conntrack_max is shared with the whole host.
		"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
	}, extra...)
}

// waitTookOver waits (30 s) until p, started beside a running proxy with the same hand-over
// socket, logs that it took over, and fails the test if p exits first.
func (p *proxyProcess) waitTookOver(t *testing.T) {
	t.Helper()
	eventually(t, 30*time.Second, "the new proxy never took over", func() error {
		if err := p.exited(); err != nil {
			return err
		}
		if !strings.Contains(p.LogTail(4000), "Took over from the running proxy") {
			return errors.New("no \"Took over\" line yet")
		}
		return nil
	})
}
