package framework

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
)

// etcdEnv is the environment etcd runs with: ours minus every ETCD_* variable, because etcd reads
// each of them as a flag (ETCD_DATA_DIR, ETCD_NAME, ...) and a stray one would change the cluster.
func etcdEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "ETCD_") {
			env = append(env, kv)
		}
	}
	return env
}

// startEtcd starts a single-member etcd on loopback with its data in dir and returns its client URL
// once /health reports healthy.
func startEtcd(ctx context.Context, bin, dir string, clientPort, peerPort int) (*process, string, error) {
	clientURL := fmt.Sprintf("http://127.0.0.1:%d", clientPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	args := []string{
		"--name=kpp-e2e",
		"--data-dir=" + filepath.Join(dir, "etcd-data"),
		"--listen-client-urls=" + clientURL,
		"--advertise-client-urls=" + clientURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kpp-e2e=" + peerURL,
		// Durability is irrelevant for a throwaway test cluster; fsync dominates its latency.
		"--unsafe-no-fsync",
	}
	p, err := startProcess("etcd", filepath.Join(dir, "etcd.log"), bin, args, etcdEnv())
	if err != nil {
		return nil, "", err
	}
	if err := p.waitReady(ctx, func(ctx context.Context) error { return etcdHealthy(ctx, clientURL) }); err != nil {
		return p, "", err
	}
	return p, clientURL, nil
}

func etcdHealthy(ctx context.Context, clientURL string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, clientURL+"/health", nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var health struct {
		Health string `json:"health"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&health); err != nil {
		return fmt.Errorf("etcd /health: %s: %w", resp.Status, err)
	}
	if health.Health != "true" {
		return fmt.Errorf("etcd /health: %s: health=%q", resp.Status, health.Health)
	}
	return nil
}
