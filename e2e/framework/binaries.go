package framework

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// The versions hack/controlplane-build.sh builds by default; the cache path convention uses them.
const (
	KubeVersion = "v1.36.3"
	EtcdVersion = "v3.6.16"
)

// Environment variables the framework reads.
const (
	// EnvAPIServer, EnvEtcd and EnvKubectl override the binaries' paths.
	EnvAPIServer = "KPP_APISERVER"
	EnvEtcd      = "KPP_ETCD"
	EnvKubectl   = "KPP_KUBECTL"
	// EnvCache is the cache root hack/controlplane-build.sh builds into
	// (default $HOME/.cache/kube-portal-proxy).
	EnvCache = "KPP_CACHE"
)

// ErrBinariesMissing reports that the control plane binaries have not been built.
var ErrBinariesMissing = errors.New("control plane binaries missing")

// Binaries are the paths of the control plane executables.
type Binaries struct {
	APIServer string
	Etcd      string
	// Kubectl may be empty: the control plane runs without it.
	Kubectl string
}

// FindBinaries locates the binaries: each from its environment variable if set, otherwise from
// the cache hack/controlplane-build.sh fills (<cache>/bin/<name>-<version>). It returns an error
// wrapping ErrBinariesMissing when kube-apiserver or etcd is not an executable file.
func FindBinaries() (Binaries, error) {
	binDir, err := cacheBinDir()
	if err != nil {
		return Binaries{}, err
	}
	b := Binaries{
		APIServer: pathFromEnv(EnvAPIServer, filepath.Join(binDir, "kube-apiserver-"+KubeVersion)),
		Etcd:      pathFromEnv(EnvEtcd, filepath.Join(binDir, "etcd-"+EtcdVersion)),
		Kubectl:   pathFromEnv(EnvKubectl, filepath.Join(binDir, "kubectl-"+KubeVersion)),
	}
	var errs []error
	for _, c := range []struct{ name, env, path string }{
		{"kube-apiserver", EnvAPIServer, b.APIServer},
		{"etcd", EnvEtcd, b.Etcd},
	} {
		if err := checkExecutable(c.path); err != nil {
			errs = append(errs, fmt.Errorf("%w: %s: %w (set %s or run hack/controlplane-build.sh)",
				ErrBinariesMissing, c.name, err, c.env))
		}
	}
	if checkExecutable(b.Kubectl) != nil {
		b.Kubectl = ""
	}
	return b, errors.Join(errs...)
}

func cacheBinDir() (string, error) {
	if dir := os.Getenv(EnvCache); dir != "" {
		return filepath.Join(dir, "bin"), nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("locate control plane cache: set %s: %w", EnvCache, err)
	}
	return filepath.Join(home, ".cache", "kube-portal-proxy", "bin"), nil
}

func pathFromEnv(name, fallback string) string {
	if p := os.Getenv(name); p != "" {
		return p
	}
	return fallback
}

func checkExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", path)
	}
	return nil
}
