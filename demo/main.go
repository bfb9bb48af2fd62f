// Command demo runs kube-portal-proxy on its embedded default with no cluster: it builds throwaway
// network namespaces (a node, two backend pods, a client pod and an external host), starts the
// proxy in the node namespace on the manifests in testdata/demo, and shows real traffic through
// the portals: round robin, ClientIP affinity, the node's own traffic, a NodePort, an external IP
// and UDP. It exits non-zero if the traffic does not behave, and removes everything it made.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

func main() {
	proxy := flag.String("proxy", "bin/kube-portal-proxy", "the kube-portal-proxy binary")
	manifests := flag.String("services", "testdata/demo", "the services file or directory to serve")
	keep := flag.Bool("keep", false, "keep everything running until Ctrl-C, to explore by hand")
	mode := flag.String("portal-mode", "iptables", "iptables (NAT portal rules) or bind (service IPs on a local interface, no NAT)")
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "demo: needs root to create network namespaces (try: sudo make demo)")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *proxy, *manifests, *mode, *keep); err != nil {
		fmt.Fprintf(os.Stderr, "demo: FAILED: %v\n", err)
		os.Exit(1)
	}
	fmt.Println("\ndemo: OK")
}

func run(ctx context.Context, proxy, manifests, mode string, keep bool) (err error) {
	proxy, _ = filepath.Abs(proxy)
	manifests, _ = filepath.Abs(manifests)
	bed, closeBed, err := testbed.Start(ctx, 2, 8080, 5353)
	defer func() { err = errors.Join(err, closeBed()) }()
	if err != nil {
		return err
	}

	logPath := filepath.Join(os.TempDir(), bed.Lab.Prefix()+"proxy.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := exec.Command("ip", "netns", "exec", bed.Node.Name, proxy, "--services-file", manifests, "--portal-mode", mode,
		// Leave conntrack sysctls alone (on older kernels nf_conntrack_max is host-wide).
		"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
		"--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", proxy, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}()
	fmt.Printf("Namespaces %s{node,client,ext,pod1,pod2}; proxy log: %s\n", bed.Lab.Prefix(), logPath)

	web := netip.MustParseAddrPort("10.96.0.10:80")
	if err := testbed.Eventually(ctx, 30*time.Second, 100*time.Millisecond, func() error {
		select {
		case err := <-exited:
			return fmt.Errorf("proxy exited: %v (see %s)", err, logPath)
		default:
		}
		_, err := testbed.Who(bed.Client, web, time.Second)
		return err
	}); err != nil {
		return fmt.Errorf("the portal never answered: %w", err)
	}

	checks := []struct {
		title string
		from  *netns.NS
		addr  string
		udp   bool
		n     int
		want  func(map[string]int) error
	}{
		{"Round robin: client pod -> cluster IP 10.96.0.10:80 (REDIRECT, KUBE-PORTALS-CONTAINER)", bed.Client, "10.96.0.10:80", false, 6, both},
		{"ClientIP affinity: client pod -> 10.96.0.11:80 (sessionAffinity: ClientIP)", bed.Client, "10.96.0.11:80", false, 6, one},
		{"The node itself -> 10.96.0.10:80 (DNAT to the node IP, KUBE-PORTALS-HOST)", bed.Node, "10.96.0.10:80", false, 4, both},
		{"NodePort: external host -> node 192.0.2.1:30080 (KUBE-NODEPORT-CONTAINER)", bed.External, "192.0.2.1:30080", false, 4, both},
		{"External IP: external host -> 203.0.113.10:80", bed.External, "203.0.113.10:80", false, 4, both},
		{"UDP: client pod -> 10.96.0.53:53, a new session per query", bed.Client, "10.96.0.53:53", true, 4, both},
	}
	for _, c := range checks {
		fmt.Printf("\n%s\n", c.title)
		seen := map[string]int{}
		for i := range c.n {
			addr := netip.MustParseAddrPort(c.addr)
			var who string
			var err error
			if c.udp {
				who, err = testbed.WhoUDP(c.from, addr, 2*time.Second)
			} else {
				who, err = testbed.Who(c.from, addr, 2*time.Second)
			}
			if err != nil {
				return fmt.Errorf("%s: request %d: %w", c.title, i+1, err)
			}
			seen[who]++
			fmt.Printf("  request %d answered by %s\n", i+1, who)
		}
		if err := c.want(seen); err != nil {
			return fmt.Errorf("%s: %w", c.title, err)
		}
	}

	if mode == "bind" {
		out, _ := bed.Node.Exec(ctx, "ip", "-o", "addr", "show", "dev", "kube-portal0")
		fmt.Printf("\nBind mode: the service IPs on kube-portal0 in the node namespace:\n%s", out)
		nat, _ := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
		if strings.Contains(string(nat), "-A ") {
			return fmt.Errorf("bind mode left rules in the nat table:\n%s", nat)
		}
		fmt.Println("The nat table has no rules.")
		return waitKeep(ctx, keep, bed)
	}
	out, _ := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
	fmt.Println("\nThe portal rules in the node namespace (iptables-save -t nat):")
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "KUBE-") {
			fmt.Println("  " + line)
		}
	}
	return waitKeep(ctx, keep, bed)
}

// waitKeep, with -keep, leaves everything running until Ctrl-C.
func waitKeep(ctx context.Context, keep bool, bed *testbed.Bed) error {
	if keep {
		fmt.Printf("\nExplore, e.g.: ip netns exec %s iptables-save; ip netns exec %s bash -c 'exec 3<>/dev/tcp/10.96.0.10/80; head -1 <&3'\nCtrl-C to clean up.\n",
			bed.Node.Name, bed.Client.Name)
		<-ctx.Done()
	}
	return nil
}

func both(seen map[string]int) error {
	if seen["pod1"] == 0 || seen["pod2"] == 0 {
		return fmt.Errorf("want both pods to answer, got %v", seen)
	}
	return nil
}

func one(seen map[string]int) error {
	if len(seen) != 1 {
		return fmt.Errorf("want one pod to answer every request, got %v", seen)
	}
	return nil
}
