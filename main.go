// Command kube-portal-proxy is a node-level Kubernetes service proxy that revives kube-proxy's
// userspace ("portal") mode: a visible proxy socket per service port, fed by portal rules.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "kube-portal-proxy: not wired yet")
	os.Exit(1)
}
