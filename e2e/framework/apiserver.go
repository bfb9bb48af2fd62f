package framework

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
)

// ServiceClusterIPRange is the range ClusterIPs are allocated from. The addresses are only data:
// nothing may send traffic to them outside the test's own network namespaces.
const ServiceClusterIPRange = "10.96.0.0/16"

// ProxyUser is the identity the proxy runs as. RBAC's bootstrap policy binds it to the
// system:node-proxier ClusterRole: list and watch services, endpointslices and nodes, create events.
const ProxyUser = "system:kube-proxy"

// identity is a static token user of the API server.
type identity struct {
	user   string
	token  string
	groups []string
}

// newIdentity gives user a random bearer token.
func newIdentity(user string, groups ...string) identity {
	return identity{user: user, token: rand.Text(), groups: groups}
}

// writeTokenFile writes the --token-auth-file CSV: token,user,uid,"group1,group2".
func writeTokenFile(path string, ids ...identity) error {
	var b strings.Builder
	for _, id := range ids {
		fmt.Fprintf(&b, "%s,%s,%s", id.token, id.user, id.user)
		if len(id.groups) > 0 {
			fmt.Fprintf(&b, ",%q", strings.Join(id.groups, ","))
		}
		b.WriteByte('\n')
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		return fmt.Errorf("write token file: %w", err)
	}
	return nil
}

// writeServiceAccountKey writes the RSA key the API server signs and verifies service account
// tokens with (one file serves both flags).
func writeServiceAccountKey(path string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("generate service account key: %w", err)
	}
	block := &pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}
	if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
		return fmt.Errorf("write service account key: %w", err)
	}
	return nil
}

// apiServer is a started kube-apiserver and what a client needs to reach it.
type apiServer struct {
	proc   *process
	url    string // https://127.0.0.1:<port>
	caFile string // the self-signed serving certificate chain it wrote into --cert-dir
}

// startAPIServer starts kube-apiserver on loopback against etcdURL, authenticating ids by token,
// and returns once /readyz is ok for admin.
func startAPIServer(ctx context.Context, bin, dir, etcdURL string, port int, admin identity, ids ...identity) (*apiServer, error) {
	tokenFile := filepath.Join(dir, "tokens.csv")
	if err := writeTokenFile(tokenFile, append([]identity{admin}, ids...)...); err != nil {
		return nil, err
	}
	saKey := filepath.Join(dir, "service-account.key")
	if err := writeServiceAccountKey(saKey); err != nil {
		return nil, err
	}
	return runAPIServer(ctx, bin, dir, etcdURL, port, admin)
}

// runAPIServer runs kube-apiserver with the files startAPIServer wrote into dir (a restart runs it
// again: same port, certificates, tokens and keys, so every client's kubeconfig stays good) and
// returns once /readyz is ok for admin. Its log is appended to.
func runAPIServer(ctx context.Context, bin, dir, etcdURL string, port int, admin identity) (*apiServer, error) {
	tokenFile := filepath.Join(dir, "tokens.csv")
	saKey := filepath.Join(dir, "service-account.key")
	certDir := filepath.Join(dir, "apiserver-certs")
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", port),
		// With no --tls-cert-file the server writes a self-signed chain here, valid for 127.0.0.1.
		"--cert-dir=" + certDir,
		"--token-auth-file=" + tokenFile,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		"--service-cluster-ip-range=" + ServiceClusterIPRange,
		// No kubelet answers on 127.0.0.1: the default reconciler would keep rewriting
		// default/kubernetes endpoints forever.
		"--endpoint-reconciler-type=none",
		"--profiling=false",
	}
	p, err := startProcess("kube-apiserver", filepath.Join(dir, "kube-apiserver.log"), bin, args, os.Environ())
	if err != nil {
		return nil, err
	}
	s := &apiServer{proc: p, url: fmt.Sprintf("https://127.0.0.1:%d", port), caFile: filepath.Join(certDir, "apiserver.crt")}
	if err := p.waitReady(ctx, func(ctx context.Context) error { return s.ready(ctx, admin.token) }); err != nil {
		return s, err
	}
	return s, nil
}

// ready reports whether GET /readyz answers "ok". /readyz covers etcd, the RBAC bootstrap roles and
// the authorizer's informers, so every identity works once it passes.
func (s *apiServer) ready(ctx context.Context, token string) error {
	caPEM, err := os.ReadFile(s.caFile)
	if err != nil {
		return err // not written yet
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %s", s.caFile)
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	defer client.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+"/readyz", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || strings.TrimSpace(string(body)) != "ok" {
		return fmt.Errorf("/readyz: %s: %s", resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
