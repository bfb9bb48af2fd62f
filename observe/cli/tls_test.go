package cli

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// testCA issues certificates for the TLS test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// issue returns a certificate and key (PEM) for cn, valid for ips, for usage.
func (ca *testCA) issue(t *testing.T, cn string, ips []net.IP, usage x509.ExtKeyUsage) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: ips,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
}

// TestNodeTLSClientCertificate: over https, a kubeconfig user with a client certificate presents
// it to the node's proxy, and the proxy's certificate is checked against --certificate-authority,
// not the kubeconfig's CA (the API server's).
func TestNodeTLSClientCertificate(t *testing.T) {
	nodeCA, userCA, apiCA := newTestCA(t), newTestCA(t), newTestCA(t)
	srvCert, srvKey := nodeCA.issue(t, "node-a", []net.IP{net.ParseIP(nodeIP(0))}, x509.ExtKeyUsageServerAuth)
	pair, err := tls.X509KeyPair(srvCert, srvKey)
	if err != nil {
		t.Fatal(err)
	}
	clients := x509.NewCertPool()
	clients.AddCert(userCA.cert)
	p := newFakeProxy(t, webFlow("node-a", 0))
	port := serveNodesTLS(t, &tls.Config{Certificates: []tls.Certificate{pair}, ClientCAs: clients, ClientAuth: tls.RequireAndVerifyClientCert}, p)

	dir := t.TempDir()
	userCert, userKey := userCA.issue(t, "alice", nil, x509.ExtKeyUsageClientAuth)
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://127.0.0.1:1", CertificateAuthorityData: apiCA.pem}
	cfg.AuthInfos["u"] = &clientcmdapi.AuthInfo{ClientCertificateData: userCert, ClientKeyData: userKey}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "u"}
	cfg.CurrentContext = "c"
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	caFile := filepath.Join(dir, "node-ca.pem")
	if err := os.WriteFile(caFile, nodeCA.pem, 0o600); err != nil {
		t.Fatal(err)
	}
	env := Env{NewClientset: fakeClientset(node("node-a", 0))}
	args := []string{"--node", "node-a", "--kubeconfig", kubeconfig, "--port", strconv.Itoa(port), "--scheme", "https"}

	r := observeCmd(context.Background(), env, append(args, "--certificate-authority", caFile)...)
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	reqs := p.requests()
	if len(reqs) != 1 || reqs[0].TLS == nil || len(reqs[0].TLS.PeerCertificates) == 0 || reqs[0].TLS.PeerCertificates[0].Subject.CommonName != "alice" {
		t.Fatalf("the proxy did not see alice's client certificate: %d requests", len(reqs))
	}

	r = observeCmd(context.Background(), env, args...)
	if r.code != 1 || !strings.Contains(r.stderr, "certificate signed by unknown authority") {
		t.Errorf("without --certificate-authority: exit %d, stderr %q; want the node's certificate refused", r.code, r.stderr)
	}
}
