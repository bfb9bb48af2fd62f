package e2e

import (
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// startRelay starts a relay from ns's loopback to the API server at target (framework.Relay)
// and stops it when t ends.
func startRelay(t *testing.T, ns *netns.NS, target string) *framework.Relay {
	t.Helper()
	r, err := framework.StartRelay(ns, target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}
