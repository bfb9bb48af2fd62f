package framework

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// StartControlPlane starts a control plane for t and stops it in t.Cleanup. Without binaries it
// skips t, or fails it when testenv.Required() (KPP_E2E_REQUIRE is set). On failure the cleanup logs the daemons' last log lines.
func StartControlPlane(t testing.TB) *ControlPlane {
	t.Helper()
	bins, err := FindBinaries()
	if err != nil {
		skipOrFail(t, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), DefaultStartTimeout)
	defer cancel()
	// t.TempDir is removed after the cleanup below has stopped the daemons.
	start := time.Now()
	cp, err := Start(ctx, Options{Binaries: bins, Dir: t.TempDir()})
	if err != nil {
		t.Fatalf("start control plane: %v", err)
	}
	t.Logf("control plane %s ready in %v (kube-apiserver pid %d, etcd pid %d, logs in %s)",
		cp.Server, time.Since(start).Round(time.Millisecond), cp.apiserver.pid(), cp.etcd.pid(), cp.runDir)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("control plane logs:\n%s", cp.LogTail(40))
		}
		if err := cp.Stop(); err != nil {
			t.Errorf("stop control plane: %v", err)
		}
	})
	return cp
}

func skipOrFail(t testing.TB, err error) {
	t.Helper()
	if !errors.Is(err, ErrBinariesMissing) {
		t.Fatalf("e2e: %v", err)
	}
	testenv.Unavailable(t, "e2e skipped: %v", err)
}
