package framework

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

const (
	// DefaultStartTimeout bounds Start on a busy 2-core machine; an idle one is ready in ~4 s.
	DefaultStartTimeout = 90 * time.Second
	// Port races (another process binding a port between our probe and the daemon's bind) are
	// retried this many times with fresh ports.
	startAttempts = 3
	stopGrace     = 20 * time.Second
)

// Options configure Start. The zero value is usable.
type Options struct {
	// Binaries to run; FindBinaries() when APIServer is empty.
	Binaries Binaries
	// Dir holds data, certificates, kubeconfigs and logs. When empty Start makes a temporary
	// directory and Stop removes it.
	Dir string
}

// ControlPlane is a running etcd + kube-apiserver on loopback.
type ControlPlane struct {
	// Server is the API server URL, https://127.0.0.1:<port>.
	Server string
	// AdminKubeconfig authenticates as "admin" in group system:masters.
	AdminKubeconfig string
	// ProxyKubeconfig authenticates as system:kube-proxy (ProxyUser), the proxy's identity.
	ProxyKubeconfig string
	// Dir holds everything the control plane wrote: a runN directory per start attempt with data,
	// certificates, kubeconfigs, etcd.log and kube-apiserver.log.
	Dir      string
	Binaries Binaries

	adminConfig *rest.Config
	proxyConfig *rest.Config
	admin       kubernetes.Interface
	proxy       kubernetes.Interface

	etcd      *process
	apiserver *process
	// restartEtcd and restartAPIServer run the daemon again as it was started (Restart*).
	restartEtcd      func(context.Context) (*process, error)
	restartAPIServer func(context.Context) (*process, error)
	restartMu        sync.Mutex
	runDir           string // the attempt's directory under Dir: data, certificates, logs
	removeDir        bool

	stopOnce sync.Once
	stopErr  error
}

// Start starts etcd and kube-apiserver and returns once the API server is ready. The caller must
// call Stop, also when tests fail. On error nothing is left running.
func Start(ctx context.Context, opts Options) (*ControlPlane, error) {
	bins := opts.Binaries
	if bins.APIServer == "" {
		var err error
		if bins, err = FindBinaries(); err != nil {
			return nil, err
		}
	}
	dir, removeDir := opts.Dir, false
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "kpp-controlplane-"); err != nil {
			return nil, fmt.Errorf("control plane: %w", err)
		}
		removeDir = true
	}
	var err error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		var cp *ControlPlane
		cp, err = startOnce(ctx, bins, filepath.Join(dir, fmt.Sprintf("run%d", attempt)))
		if err == nil {
			cp.Dir, cp.removeDir = dir, removeDir
			return cp, nil
		}
		if !strings.Contains(err.Error(), "address already in use") {
			break
		}
	}
	if removeDir {
		os.RemoveAll(dir)
	}
	return nil, err
}

// startOnce is one attempt of Start in its own directory.
func startOnce(ctx context.Context, bins Binaries, dir string) (_ *ControlPlane, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("control plane: %w", err)
	}
	cp := &ControlPlane{Binaries: bins, runDir: dir}
	defer func() {
		if err != nil {
			// The error already says why; stopping can only add "it had exited" or "it needed
			// SIGKILL", and either way nothing is left running.
			_ = cp.stopProcesses()
		}
	}()

	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	var etcdURL string
	cp.etcd, etcdURL, err = startEtcd(ctx, bins.Etcd, dir, ports[0], ports[1])
	if err != nil {
		return nil, err
	}
	admin := newIdentity("admin", "system:masters")
	proxy := newIdentity(ProxyUser)
	s, err := startAPIServer(ctx, bins.APIServer, dir, etcdURL, ports[2], admin, proxy)
	if s != nil {
		cp.apiserver = s.proc
	}
	if err != nil {
		return nil, err
	}
	cp.Server = s.url
	cp.restartEtcd = func(ctx context.Context) (*process, error) {
		p, _, err := startEtcd(ctx, bins.Etcd, dir, ports[0], ports[1])
		return p, err
	}
	cp.restartAPIServer = func(ctx context.Context) (*process, error) {
		s, err := runAPIServer(ctx, bins.APIServer, dir, etcdURL, ports[2], admin)
		if s == nil {
			return nil, err
		}
		return s.proc, err
	}
	cp.AdminKubeconfig = filepath.Join(dir, "admin.kubeconfig")
	cp.ProxyKubeconfig = filepath.Join(dir, "kube-proxy.kubeconfig")
	if err := writeKubeconfig(cp.AdminKubeconfig, s.url, s.caFile, admin); err != nil {
		return nil, err
	}
	if err := writeKubeconfig(cp.ProxyKubeconfig, s.url, s.caFile, proxy); err != nil {
		return nil, err
	}
	if cp.adminConfig, cp.admin, err = clientFor(cp.AdminKubeconfig); err != nil {
		return nil, err
	}
	if cp.proxyConfig, cp.proxy, err = clientFor(cp.ProxyKubeconfig); err != nil {
		return nil, err
	}
	return cp, nil
}

func clientFor(kubeconfig string) (*rest.Config, kubernetes.Interface, error) {
	cfg, err := loadKubeconfig(kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("client for %s: %w", kubeconfig, err)
	}
	return cfg, client, nil
}

// AdminClient is a client with full rights (group system:masters), for the test driver.
func (c *ControlPlane) AdminClient() kubernetes.Interface { return c.admin }

// ProxyClient is a client with the proxy's identity and rights (system:kube-proxy).
func (c *ControlPlane) ProxyClient() kubernetes.Interface { return c.proxy }

// AdminConfig returns a copy of the admin client configuration.
func (c *ControlPlane) AdminConfig() *rest.Config { return rest.CopyConfig(c.adminConfig) }

// ProxyConfig returns a copy of the system:kube-proxy client configuration.
func (c *ControlPlane) ProxyConfig() *rest.Config { return rest.CopyConfig(c.proxyConfig) }

// Kubectl runs kubectl as admin and returns its combined output.
func (c *ControlPlane) Kubectl(ctx context.Context, args ...string) ([]byte, error) {
	if c.Binaries.Kubectl == "" {
		return nil, fmt.Errorf("kubectl %s: %w: kubectl (set %s or run hack/controlplane-build.sh)",
			strings.Join(args, " "), ErrBinariesMissing, EnvKubectl)
	}
	cmd := exec.CommandContext(ctx, c.Binaries.Kubectl, append([]string{"--kubeconfig=" + c.AdminKubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// LogTail returns the last n lines of the etcd and kube-apiserver logs, for failure reports.
func (c *ControlPlane) LogTail(n int) string {
	var b strings.Builder
	for _, p := range []*process{c.apiserver, c.etcd} {
		if p != nil {
			b.WriteString(p.logTail(n))
		}
	}
	return b.String()
}

// Stop stops kube-apiserver, then etcd, by PID, and removes Dir if Start created it. It is safe to
// call more than once; later calls return the first result.
func (c *ControlPlane) Stop() error {
	c.stopOnce.Do(func() {
		c.stopErr = c.stopProcesses()
		if c.removeDir {
			if err := os.RemoveAll(c.Dir); err != nil {
				c.stopErr = errors.Join(c.stopErr, fmt.Errorf("control plane: %w", err))
			}
		}
	})
	return c.stopErr
}

// RestartAPIServer kills kube-apiserver (its graceful shutdown waits out its watches, tens of
// seconds) and starts it again on the same port with the same certificates and credentials, and
// returns once it is ready: clients see their watches end and their requests refused meanwhile.
func (c *ControlPlane) RestartAPIServer(ctx context.Context) error {
	c.restartMu.Lock()
	defer c.restartMu.Unlock()
	c.apiserver.Kill()
	p, err := c.restartAPIServer(ctx)
	if p != nil {
		c.apiserver = p
	}
	if err != nil {
		return fmt.Errorf("restart kube-apiserver: %w", err)
	}
	return nil
}

// RestartEtcd kills etcd and starts it again on its data, and returns once it is healthy;
// kube-apiserver keeps running and reconnects.
func (c *ControlPlane) RestartEtcd(ctx context.Context) error {
	c.restartMu.Lock()
	defer c.restartMu.Unlock()
	c.etcd.Kill()
	p, err := c.restartEtcd(ctx)
	if p != nil {
		c.etcd = p
	}
	if err != nil {
		return fmt.Errorf("restart etcd: %w", err)
	}
	return nil
}

// stopProcesses stops the API server before etcd, so the server never runs without its storage.
func (c *ControlPlane) stopProcesses() error {
	var errs []error
	for _, p := range []*process{c.apiserver, c.etcd} {
		if p != nil {
			errs = append(errs, p.stop(stopGrace))
		}
	}
	return errors.Join(errs...)
}
