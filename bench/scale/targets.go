package main

// targets.go is what -cluster runs: kube-portal-proxy binaries (-proxy, -baseline) and today's
// kube-proxy (-kube-proxy, built by hack/kubeproxy-build.sh) in each of its -kube-proxy-modes,
// each the real process in its own node namespace against the same API server.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// nodeName is the node every target says it runs on (--hostname-override); bench/scale creates
// it with the node namespace's address, which kube-proxy waits up to 30 s for.
const nodeName = "node1"

// metricsAddr is where every target serves /metrics, on the node namespace's loopback only.
const metricsAddr = "127.0.0.1:10249"

// target is one proxy under test.
type target struct {
	name string // how the tables name it
	bin  string
	// mode is kube-proxy's --proxy-mode ("iptables", "nftables"); empty for kube-portal-proxy.
	mode string
	// minSync is the minimum sync period every target gets (-min-sync-period): the daemon's
	// --iptables-min-sync-period, kube-proxy's iptables.minSyncPeriod or nftables.minSyncPeriod.
	// The same for all, so that neither batches changes longer than the other.
	minSync time.Duration
}

func (t target) kubeProxy() bool { return t.mode != "" }

// command is the target's command line in the node namespace, with its files in dir.
func (t target) command(bed *testbed.Bed, kubeconfig, dir string) (*exec.Cmd, error) {
	if !t.kubeProxy() {
		profiling, err := profilingConfig()
		if err != nil {
			return nil, err
		}
		return exec.Command("ip", "netns", "exec", bed.Node.Name, t.bin, "--config", profiling, "--kubeconfig", kubeconfig, "--hostname-override", nodeName,
			"--healthz-bind-address", "", "--metrics-bind-address", metricsAddr, "--log-level", "info",
			"--iptables-min-sync-period", t.minSync.String(),
			"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0"), nil
	}
	// kube-proxy as an operator runs it: its defaults (30 s full resync) but for the minimum
	// sync period, the same as the daemon's (-min-sync-period; kube-proxy's default is 1 s), and
	// the conntrack sysctls, which it may not set in a namespace here (and the daemon is told the
	// same).
	cfg := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: %s
hostnameOverride: %s
clientConnection:
  kubeconfig: %s
metricsBindAddress: %s
healthzBindAddress: 127.0.0.1:10256
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
%s:
  minSyncPeriod: %s
`, t.mode, nodeName, kubeconfig, metricsAddr, t.mode, t.minSync)
	path := filepath.Join(dir, "kube-proxy-config.yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	return exec.Command("ip", "netns", "exec", bed.Node.Name, t.bin, "--config", path), nil
}

// rulesInForce checks that the node holds a rule for each of n service ports and e endpoints:
// the daemon's portals, or kube-proxy's service entries and DNAT rules (iptables or nftables).
func (t target) rulesInForce(ctx context.Context, bed *testbed.Bed, n, e int) error {
	switch t.mode {
	case "":
		out, err := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
		if err != nil {
			return err
		}
		if got := strings.Count(string(out), "-A KUBE-PORTALS-CONTAINER"); got < n {
			return fmt.Errorf("%d of %d portal rules", got, n)
		}
		return nil
	case "iptables":
		out, err := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
		if err != nil {
			return err
		}
		return countRules(string(out), n, e, "-A KUBE-SERVICES ", " -j KUBE-SVC-", "-j DNAT")
	default:
		out, err := bed.Node.Exec(ctx, "nft", "list", "table", "ip", "kube-proxy")
		if err != nil {
			return err
		}
		// A service chain DNATs straight to its endpoints (nft 1.0.6 lists it as "dnat ip to numgen random
		// mod 5 map { 0 : 10.245.0.1 . 8080, 1 : ... }"), one map element per endpoint.
		services, endpoints := 0, 0
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, ": goto service-") {
				services++
			}
			if strings.Contains(l, " dnat ip ") && strings.Contains(l, " map { ") {
				endpoints += strings.Count(l, " : ")
			}
		}
		if services < n || endpoints < e {
			return fmt.Errorf("%d of %d service map entries, %d of %d endpoint map entries", services, n, endpoints, e)
		}
		return nil
	}
}

// countRules counts iptables-save lines holding svcPrefix and svcMark (service ports) and lines
// holding dnat (endpoints).
func countRules(out string, n, e int, svcPrefix, svcMark, dnat string) error {
	services, endpoints := 0, 0
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, svcMark) && strings.Contains(l, svcPrefix) {
			services++
		}
		if strings.Contains(l, dnat) {
			endpoints++
		}
	}
	if services < n || endpoints < e {
		return fmt.Errorf("%d of %d service rules, %d of %d endpoint rules", services, n, endpoints, e)
	}
	return nil
}

// parseTargets builds the list: the daemon binaries, then kube-proxy in each mode.
func parseTargets(proxy, baseline, kubeProxy, modes string, minSync time.Duration) ([]target, error) {
	var out []target
	for i, p := range append([]string{proxy}, strings.Fields(baseline)...) {
		abs, err := filepath.Abs(p)
		if err != nil {
			return nil, err
		}
		name := "kpp"
		if i > 0 {
			name = fmt.Sprintf("kpp-baseline%d", i)
			if len(strings.Fields(baseline)) == 1 {
				name = "kpp-baseline"
			}
		}
		out = append(out, target{name: name, bin: abs, minSync: minSync})
	}
	if kubeProxy == "" {
		return out, nil
	}
	abs, err := filepath.Abs(kubeProxy)
	if err != nil {
		return nil, err
	}
	for _, m := range strings.Split(modes, ",") {
		switch m = strings.TrimSpace(m); m {
		case "iptables", "nftables":
			out = append(out, target{name: "kube-proxy-" + m, bin: abs, mode: m, minSync: minSync})
		case "":
		default:
			return nil, fmt.Errorf("-kube-proxy-modes: %q is not iptables or nftables", m)
		}
	}
	return out, nil
}
