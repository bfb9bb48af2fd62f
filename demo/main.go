// Command demo runs kube-portal-proxy on its embedded default with no cluster: it builds throwaway
// network namespaces (a node, two backend pods, a client pod and an external host), starts the
// proxy in the node namespace on the manifests in testdata/demo, and shows real traffic through
// the portals: round robin, ClientIP affinity, the node's own traffic, a NodePort, an external IP
// and UDP. It exits non-zero if the traffic does not behave or the proxy stops early (quoting the
// proxy's exit status and log), and removes everything it made, with a deadline on every wait.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/child"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

func main() {
	var cfg config
	flag.StringVar(&cfg.proxy, "proxy", "bin/kube-portal-proxy", "the kube-portal-proxy binary")
	flag.StringVar(&cfg.manifests, "services", "testdata/demo", "the services file or directory to serve")
	flag.BoolVar(&cfg.keep, "keep", false, "keep everything running until Ctrl-C, to explore by hand")
	flag.StringVar(&cfg.mode, "portal-mode", "iptables", "iptables (NAT portal rules) or bind (service IPs on a local interface, no NAT)")
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "demo: needs root to create network namespaces: run it as root, or with sudo (sudo make demo)")
		os.Exit(2)
	}
	if err := checkTools(cfg.mode); err != nil {
		fmt.Fprintf(os.Stderr, "demo: %v\n", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, cfg); err != nil {
		fmt.Fprintf(os.Stderr, "demo: FAILED: %v\n", err)
		os.Exit(1)
	}
	fmt.Println("\ndemo: OK")
}

// config is what the demo runs.
type config struct {
	proxy, manifests, mode string
	keep                   bool
	// proxyEnv is the proxy's environment; nil means the demo's own.
	proxyEnv []string
}

// The demo's deadlines: every wait ends.
const (
	readyTimeout = 30 * time.Second // the proxy's first sync, until the portal answers
	stopGrace    = 15 * time.Second // SIGTERM to exit (the proxy's --shutdown-timeout is 10s), and again after SIGKILL
	// trafficTimeout bounds the requests (at most 28, 2s each) and the rule dumps.
	trafficTimeout = 2 * time.Minute
)

// checkTools fails at once, with the fix, when a command the demo runs is missing, rather than
// half-way through with an exec error.
func checkTools(mode string) error {
	tools := []string{"ip"}
	if mode == "iptables" {
		tools = append(tools, "iptables", "iptables-save", "iptables-restore")
	}
	var missing []string
	for _, t := range tools {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("not found in PATH: %s; install them with: hack/install-deps.sh demo (as root; on Debian/Ubuntu it runs apt-get install iproute2 iptables)", strings.Join(missing, ", "))
	}
	return nil
}

func run(ctx context.Context, out io.Writer, cfg config) (err error) {
	proxy, _ := filepath.Abs(cfg.proxy)
	manifests, _ := filepath.Abs(cfg.manifests)
	if _, err := os.Stat(proxy); err != nil {
		return fmt.Errorf("proxy binary: %w (build it with: make build)", err)
	}
	bed, closeBed, err := testbed.Start(ctx, 2, 8080, 5353)
	defer func() { err = errors.Join(err, closeBed()) }()
	if err != nil {
		return err
	}

	logPath := filepath.Join(os.TempDir(), bed.Lab.Prefix()+"proxy.log")
	argv := append(bed.Node.CommandPrefix(), proxy, "--services-file", manifests, "--portal-mode", cfg.mode,
		// Leave conntrack sysctls alone (on older kernels nf_conntrack_max is host-wide).
		"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
		"--healthz-bind-address", "127.0.0.1:10256", "--metrics-bind-address", "127.0.0.1:10249",
		// The node the manifests' endpoints name: the flow stream shows it.
		"--hostname-override", "demo-node")
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = cfg.proxyEnv
	p, err := child.Start("proxy", cmd, logPath)
	if err != nil {
		return err
	}
	// Stopped before the namespaces go (the defer above runs after this one).
	defer func() { err = errors.Join(err, p.Stop(stopGrace)) }()
	fmt.Fprintf(out, "Namespaces %s{node,client,ext,pod1,pod2}; proxy log: %s\n", bed.Lab.Prefix(), logPath)

	web := netip.MustParseAddrPort("10.96.0.10:80")
	if err := p.WaitReady(ctx, readyTimeout, 100*time.Millisecond, func(context.Context) error {
		_, err := testbed.Who(bed.Client, web, time.Second)
		return err
	}); err != nil {
		return fmt.Errorf("the portal never answered: %w", err)
	}
	// The proxy's metrics address is the node namespace's loopback: forward the host's to it, so
	// `kube-portal-proxy observe` on the host watches the demo's traffic.
	fwd, err := framework.StartForward(bed.Node, observeAddr, "127.0.0.1:10249")
	if err != nil {
		if fwd, err = framework.StartForward(bed.Node, "127.0.0.1:0", "127.0.0.1:10249"); err != nil {
			return err
		}
	}
	defer fwd.Close()
	if err := showTraffic(ctx, out, bed, cfg.mode); err != nil {
		return p.Annotate(err)
	}
	if err := showFlows(ctx, out, proxy, fwd.Addr()); err != nil {
		return p.Annotate(err)
	}
	return waitKeep(ctx, out, cfg.keep, bed, observeCommand(proxy, fwd.Addr()))
}

// showFlows prints what `kube-portal-proxy observe` shows of the round-robin requests: the last
// ones the proxy keeps in its flow ring, one line each, with the pod that answered.
func showFlows(ctx context.Context, out io.Writer, proxy, addr string) error {
	const title = "The same requests as the proxy saw them: kube-portal-proxy observe --service demo/web --last 6"
	fmt.Fprintf(out, "\n%s\n", title)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, proxy, "observe", "--address", addr, "--service", "demo/web", "--last", "6", "--color", "never", "-o", "wide")
	got, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w\n%s", title, err, got)
	}
	for _, want := range []string{"(pod1)", "(pod2)", "forwarded"} {
		if !strings.Contains(string(got), want) {
			return fmt.Errorf("%s: no %q in:\n%s", title, want, got)
		}
	}
	for _, line := range strings.Split(strings.TrimRight(string(got), "\n"), "\n") {
		fmt.Fprintln(out, "  "+line)
	}
	return nil
}

// observeAddr is where the demo forwards the proxy's metrics address on the host: the address
// `kube-portal-proxy observe` reaches by default (another port if it is taken).
const observeAddr = "127.0.0.1:10249"

// observeCommand is the command that watches the demo's web Service live.
func observeCommand(proxy, addr string) string {
	cmd := proxy + " observe --service demo/web --follow"
	if addr != observeAddr {
		cmd += " --address " + addr
	}
	return cmd
}

// showTraffic sends requests through every kind of portal and shows which pod answered.
func showTraffic(ctx context.Context, out io.Writer, bed *testbed.Bed, mode string) error {
	// Each request has its own timeout; this bounds the commands run in the node namespace too.
	ctx, cancel := context.WithTimeout(ctx, trafficTimeout)
	defer cancel()
	for _, c := range trafficChecks(bed) {
		if err := c.run(out); err != nil {
			return err
		}
	}
	if err := showRefusal(out, bed); err != nil {
		return err
	}
	return showPortals(ctx, out, bed, mode)
}

// trafficCheck is n requests from one namespace to one service address; want judges which pods
// answered how often.
type trafficCheck struct {
	title string
	from  *netns.NS
	addr  string
	udp   bool
	n     int
	want  func(map[string]int) error
}

func trafficChecks(bed *testbed.Bed) []trafficCheck {
	return []trafficCheck{
		{"Round robin: client pod -> cluster IP 10.96.0.10:80 (REDIRECT, KUBE-PORTALS-CONTAINER)", bed.Client, "10.96.0.10:80", false, 6, both},
		{"ClientIP affinity: client pod -> 10.96.0.11:80 (sessionAffinity: ClientIP)", bed.Client, "10.96.0.11:80", false, 6, one},
		{"The node itself -> 10.96.0.10:80 (DNAT to the node IP, KUBE-PORTALS-HOST)", bed.Node, "10.96.0.10:80", false, 4, both},
		{"NodePort: external host -> node 192.0.2.1:30080 (KUBE-NODEPORT-CONTAINER)", bed.External, "192.0.2.1:30080", false, 4, both},
		{"External IP: external host -> 203.0.113.10:80", bed.External, "203.0.113.10:80", false, 4, both},
		{"UDP: client pod -> 10.96.0.53:53, a new session per query", bed.Client, "10.96.0.53:53", true, 4, both},
	}
}

// run sends the check's requests, printing which pod answered each.
func (c *trafficCheck) run(out io.Writer) error {
	fmt.Fprintf(out, "\n%s\n", c.title)
	seen := map[string]int{}
	addr := netip.MustParseAddrPort(c.addr)
	for i := range c.n {
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
		fmt.Fprintf(out, "  request %d answered by %s\n", i+1, who)
	}
	if err := c.want(seen); err != nil {
		return fmt.Errorf("%s: %w", c.title, err)
	}
	return nil
}

// showPortals shows how the portals are made in the node namespace: the service IPs on
// kube-portal0 and an empty nat table in bind mode, else the portal rules.
func showPortals(ctx context.Context, out io.Writer, bed *testbed.Bed, mode string) error {
	if mode == "bind" {
		addrs, _ := bed.Node.Exec(ctx, "ip", "-o", "addr", "show", "dev", "kube-portal0")
		fmt.Fprintf(out, "\nBind mode: the service IPs on kube-portal0 in the node namespace:\n%s", addrs)
		nat, _ := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
		if strings.Contains(string(nat), "-A ") {
			return fmt.Errorf("bind mode left rules in the nat table:\n%s", nat)
		}
		fmt.Fprintln(out, "The nat table has no rules.")
		return nil
	}
	nat, _ := bed.Node.Exec(ctx, "iptables-save", "-t", "nat")
	fmt.Fprintln(out, "\nThe portal rules in the node namespace (iptables-save -t nat):")
	for _, line := range strings.Split(string(nat), "\n") {
		if strings.Contains(line, "KUBE-") {
			fmt.Fprintln(out, "  "+line)
		}
	}
	return nil
}

// showRefusal connects to a service with no endpoints: the kernel refuses it at once.
func showRefusal(out io.Writer, bed *testbed.Bed) error {
	const title = "No endpoints: client pod -> 10.96.0.12:80 (service idle has no EndpointSlice)"
	fmt.Fprintf(out, "\n%s\n", title)
	start := time.Now()
	_, err := testbed.Who(bed.Client, netip.MustParseAddrPort("10.96.0.12:80"), 2*time.Second)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("%s: got %v, want connection refused", title, err)
	}
	fmt.Fprintf(out, "  connection refused after %v, as kube-proxy does\n", time.Since(start).Round(10*time.Microsecond))
	return nil
}

// waitKeep, with -keep, leaves everything running until Ctrl-C, with the client pod sending a
// request to the web Service every second (at most keepTraffic long), to watch live.
func waitKeep(ctx context.Context, out io.Writer, keep bool, bed *testbed.Bed, observe string) error {
	if !keep {
		return nil
	}
	fmt.Fprintf(out, "\nWatch the client pod's requests (one a second) live, in another terminal:\n  %s\n", observe)
	fmt.Fprintf(out, "Explore, e.g.: ip netns exec %s iptables-save; ip netns exec %s bash -c 'exec 3<>/dev/tcp/10.96.0.10/80; head -1 <&3'\nCtrl-C to clean up.\n",
		bed.Node.Name, bed.Client.Name)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	stop := time.After(keepTraffic)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-stop:
			<-ctx.Done()
			return nil
		case <-tick.C:
			_, _ = testbed.Who(bed.Client, netip.MustParseAddrPort("10.96.0.10:80"), 2*time.Second)
		}
	}
}

// keepTraffic bounds the requests -keep sends.
const keepTraffic = time.Hour

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
