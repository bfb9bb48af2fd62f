// Command controlplane runs the end-to-end control plane (etcd + kube-apiserver, see
// e2e/framework) until interrupted, for trying the proxy by hand:
//
//	go run ./hack/controlplane
//
// It prints the API server URL, the kubeconfig paths and the data directory as NAME=value lines,
// then waits for SIGINT or SIGTERM and stops both daemons (they also die with it if it is killed).
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "controlplane: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	startCtx, cancel := context.WithTimeout(ctx, framework.DefaultStartTimeout)
	cp, err := framework.Start(startCtx, framework.Options{})
	cancel()
	if err != nil {
		return err
	}
	fmt.Printf("KPP_SERVER=%s\nKPP_ADMIN_KUBECONFIG=%s\nKPP_PROXY_KUBECONFIG=%s\nKPP_CONTROLPLANE_DIR=%s\n",
		cp.Server, cp.AdminKubeconfig, cp.ProxyKubeconfig, cp.Dir)
	fmt.Fprintln(os.Stderr, "controlplane: running; interrupt to stop")
	<-ctx.Done()
	return cp.Stop()
}
