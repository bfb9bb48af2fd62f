package e2e

import (
	"bytes"
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// ofService returns the rules of one service (every port): comment "namespace/name:port".
func (rs ruleSet) ofService(namespace, name string) ruleSet {
	var out ruleSet
	for _, r := range rs {
		if strings.Contains(r.text, `--comment "`+namespace+`/`+name+`:`) {
			out = append(out, r)
		}
	}
	return out
}

// TestServiceDeleted deletes one of two services: its portal rules go, its proxy sockets and held
// node port close, its cluster IP stops answering, and the other service is untouched.
func TestServiceDeleted(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	doomed := n.createService(t, "doomed", webSpec(corev1.ServiceTypeNodePort, externalIP()))
	kept := n.createService(t, "kept", webSpec(corev1.ServiceTypeClusterIP))
	n.setEndpoints(t, doomed, 1, 2)
	n.setEndpoints(t, kept, 1, 2)
	proxy := n.startProxy(t)
	doomedAddr, keptAddr := targetsOf(t, doomed).clusterTCP, targetsOf(t, kept).clusterTCP
	eventually(t, 30*time.Second, "the services never answered", func() error {
		if err := proxy.exited(); err != nil {
			return err
		}
		if _, err := whoTCP(n.bed.Client, doomedAddr); err != nil {
			return err
		}
		_, err := whoTCP(n.bed.Client, keptAddr)
		return err
	})
	keptRules := rules(t, n.bed.Node).ofService(n.namespace, "kept").texts()
	doomedRules := rules(t, n.bed.Node).ofService(n.namespace, "doomed")
	// The node port and the proxy sockets of both ports (TCP and UDP) of the doomed service.
	ports := append(doomedRules.proxyPorts(), uint16(doomed.Spec.Ports[0].NodePort), uint16(doomed.Spec.Ports[1].NodePort))
	slices.Sort(ports)
	if len(doomedRules.proxyPorts()) != 2 {
		t.Fatalf("proxy ports of %s/doomed in its rules: %v, want 2 (http, dns):\n%s", n.namespace, doomedRules.proxyPorts(), strings.Join(doomedRules.texts(), "\n"))
	}
	if open := openOf(listening(t, n.bed.Node), ports); !slices.Equal(open, ports) {
		t.Fatalf("before the delete: ports %v open in the node namespace, want %v (proxy sockets and held node ports)", open, ports)
	}

	if err := n.admin.CoreV1().Services(n.namespace).Delete(t.Context(), doomed.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete service: %v", err)
	}
	if err := n.admin.DiscoveryV1().EndpointSlices(n.namespace).Delete(t.Context(), endpointSlice(doomed).Name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete endpointslice: %v", err)
	}

	eventually(t, 15*time.Second, "the deleted service's rules stayed", func() error {
		if left := rules(t, n.bed.Node).ofService(n.namespace, "doomed"); len(left) > 0 {
			return fmt.Errorf("%d rules left:\n%s", len(left), strings.Join(left.texts(), "\n"))
		}
		return nil
	})
	eventually(t, 15*time.Second, "the deleted service's ports stayed open", func() error {
		if open := openOf(listening(t, n.bed.Node), ports); len(open) > 0 {
			return fmt.Errorf("ports %v still open in the node namespace", open)
		}
		return nil
	})
	if who, err := whoTCP(n.bed.Client, doomedAddr); err == nil {
		t.Errorf("deleted service %s still answered, by %s", doomedAddr, who)
	}
	if who, err := whoTCP(n.bed.Client, keptAddr); err != nil {
		t.Errorf("the other service %s: %v (answered by %q)", keptAddr, err, who)
	}
	if diff := cmp.Diff(keptRules, rules(t, n.bed.Node).ofService(n.namespace, "kept").texts()); diff != "" {
		t.Errorf("rules of the other service changed (-before +after):\n%s", diff)
	}
}

// openOf returns the ports of want that are open.
func openOf(open map[uint16]bool, want []uint16) []uint16 {
	var out []uint16
	for _, p := range want {
		if open[p] {
			out = append(out, p)
		}
	}
	return out
}

// shape is a rule set with its proxy ports, which a restart changes, replaced by "PORT", sorted.
// Proxy ports are ephemeral ports, so they never equal a service port or node port.
func shape(rs ruleSet) []string {
	var numbers []*regexp.Regexp
	for _, p := range rs.proxyPorts() {
		numbers = append(numbers, regexp.MustCompile(`([ :])`+strconv.Itoa(int(p))+`\b`))
	}
	out := rs.texts()
	for i := range out {
		for _, re := range numbers {
			out[i] = re.ReplaceAllString(out[i], "${1}PORT")
		}
	}
	slices.Sort(out)
	return out
}

// TestProxyKilledAndRestarted SIGKILLs the proxy (its rules stay, pointing at sockets that died),
// damages the rules while it is down, and restarts it: the rules are repaired, traffic flows on
// every path again, and no rule is duplicated.
func TestProxyKilledAndRestarted(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	svc := n.createService(t, "web", webSpec(corev1.ServiceTypeNodePort, externalIP()))
	n.setEndpoints(t, svc, 1, 2)
	first := n.startProxy(t)
	tg := targetsOf(t, svc)
	first.waitAnswers(t, n.bed.Client, tg.clusterTCP, "the service never answered")
	before := rules(t, n.bed.Node)
	want := shape(before.of(n.namespace))

	first.Kill()
	if who, err := whoTCP(n.bed.Client, tg.clusterTCP); err == nil {
		t.Fatalf("%s answered (by %s) with the proxy killed", tg.clusterTCP, who)
	}
	if got := shape(rules(t, n.bed.Node).of(n.namespace)); !cmp.Equal(want, got) {
		t.Fatalf("the killed proxy's rules changed (-want +got):\n%s", cmp.Diff(want, got))
	}
	// While it is down: lose the host portals and duplicate a container portal.
	dup := before.of(n.namespace).in("KUBE-PORTALS-CONTAINER")[0].text
	n.bed.Node.MustExec(t, "iptables", "-t", "nat", "-F", "KUBE-PORTALS-HOST")
	restoreNoFlush(t, n.bed.Node, "*nat\n"+dup+"\nCOMMIT\n")

	second := n.startProxy(t)
	eventually(t, 30*time.Second, "traffic never came back after the restart", func() error {
		if err := second.exited(); err != nil {
			return err
		}
		for _, c := range []struct {
			from *netns.NS
			ask  asker
			addr netip.AddrPort
		}{
			{n.bed.Client, whoTCP, tg.clusterTCP},
			{n.bed.Node, whoTCP, tg.clusterTCP},
			{n.bed.Client, whoUDP, tg.clusterUDP},
			{n.bed.External, whoTCP, tg.nodePort},
			{n.bed.External, whoTCP, tg.externalIP},
		} {
			if _, err := c.ask(c.from, c.addr); err != nil {
				return fmt.Errorf("from %s to %s: %w", c.from.Name, c.addr, err)
			}
		}
		return nil
	})
	after := rules(t, n.bed.Node)
	if got := shape(after.of(n.namespace)); !cmp.Equal(want, got) {
		t.Errorf("rules after the restart (-before the kill +after the restart):\n%s", cmp.Diff(want, got))
	}
	if dups := after.duplicates(); len(dups) > 0 {
		t.Errorf("duplicate rules after the restart:\n%s", strings.Join(dups, "\n"))
	}
	open := listening(t, n.bed.Node)
	for _, p := range after.of(n.namespace).proxyPorts() {
		if !open[p] {
			t.Errorf("rules send traffic to port %d, where nothing listens: the restart left stale rules", p)
		}
	}
	checkHealthy(t, n.bed.Node)
}

// restoreNoFlush feeds rules to iptables-restore --noflush in ns.
func restoreNoFlush(t *testing.T, ns *netns.NS, rules string) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), "ip", "netns", "exec", ns.Name, "iptables-restore", "--noflush")
	cmd.Stdin = strings.NewReader(rules)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("iptables-restore --noflush in %s: %v: %s\ninput:\n%s", ns.Name, err, stderr.String(), rules)
	}
}

// TestCleanupLeavesNothing stops the proxy (a clean stop keeps the rules, so a restart does not
// black-hole services) and runs --cleanup: no chain or rule of the proxy is left in either family,
// and a second --cleanup succeeds on the clean tables.
func TestCleanupLeavesNothing(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	svc := n.createService(t, "web", webSpec(corev1.ServiceTypeNodePort, externalIP()))
	n.setEndpoints(t, svc, 1, 2)
	// A second Service on the kernel data path: its chains must go too.
	quiet := n.annotatedService(t, "quiet", map[string]string{annotationDataPath: "kernel"})
	n.setEndpoints(t, quiet, 1, 2)
	proxy := n.startProxy(t)
	tg := targetsOf(t, svc)
	proxy.waitAnswers(t, n.bed.Client, tg.clusterTCP, "the service never answered")
	proxy.waitAnswers(t, n.bed.Client, targetsOf(t, quiet).clusterTCP, "the kernel-path service never answered")
	if err := proxy.stop(); err != nil {
		t.Fatalf("stop the proxy: %v", err)
	}
	_, saved := saveRules(t, n.bed.Node, "iptables-save")
	if left := ownedLines(saved); len(left) == 0 || !strings.Contains(saved, "KUBE-SEP-") {
		t.Fatalf("no proxy chain (or no kernel-path chain) in the node namespace after a clean stop; want the rules kept:\n%s", saved)
	}
	if strings.Contains(saved, "KUBE-PORTALS-TRANSPARENT") {
		t.Errorf("the transparent source mode used iptables (an nft table marks the replies now):\n%s", saved)
	}
	if left := transparentPlumbing(t, n.bed.Node); len(left) != 6 {
		t.Fatalf("the transparent source mode's plumbing after a clean stop: %q, want its rule and route in both families and its two nft tables (inet, bridge)", left)
	}

	for i := 1; i <= 2; i++ {
		out, err := runProxyOnce(t, n.bed.Node, "--cleanup")
		if err != nil {
			t.Fatalf("--cleanup run %d: %v\n%s", i, err, out)
		}
		for _, tool := range []string{"iptables-save", "ip6tables-save"} {
			_, saved := saveRules(t, n.bed.Node, tool)
			if left := ownedLines(saved); len(left) > 0 {
				t.Errorf("%s after --cleanup run %d still has:\n%s", tool, i, strings.Join(left, "\n"))
			}
		}
		if left := transparentPlumbing(t, n.bed.Node); len(left) > 0 {
			t.Errorf("after --cleanup run %d the transparent source mode left: %q", i, left)
		}
	}
	if who, err := whoTCP(n.bed.Client, tg.clusterTCP); err == nil {
		t.Errorf("%s answered (by %s) after --cleanup", tg.clusterTCP, who)
	}
}

// transparentPlumbing lists what of the transparent source mode's policy routing and nft tables is
// in ns: each ip rule to its table and each route in it (both families), and the nft tables (the
// inet one that marks the replies, the bridge one).
func transparentPlumbing(t *testing.T, ns *netns.NS) []string {
	t.Helper()
	var out []string
	for _, cmd := range [][]string{{"ip", "-4", "rule"}, {"ip", "-6", "rule"}, {"ip", "-4", "route", "show", "table", "all"},
		{"ip", "-6", "route", "show", "table", "all"}, {"nft", "list", "tables"}} {
		b, err := ns.Exec(t.Context(), cmd...)
		if err != nil {
			t.Fatalf("%v in %s: %v", cmd, ns.Name, err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, "27504") || strings.Contains(line, "bridge kube-portal-proxy") ||
				strings.Contains(line, "inet kube-portal-proxy") {
				out = append(out, strings.Join(cmd, " ")+": "+strings.TrimSpace(line))
			}
		}
	}
	return out
}

// ownedLines returns the lines of an iptables-save output that mention a chain of the proxy.
func ownedLines(saved string) []string {
	var out []string
	for _, line := range strings.Split(saved, "\n") {
		for _, c := range ownedChains {
			if strings.Contains(line, c) {
				out = append(out, line)
				break
			}
		}
	}
	return out
}

// TestProxyKilledRestartWindow measures what clients see when the proxy is SIGKILLed and started
// again at once, as a DaemonSet or systemd does: a client connects through the cluster IP in a
// loop, and the refused window is the span of failed attempts. The rules of the killed process stay
// in force; the new process reopens the proxy ports they point at before it has read anything, and
// holds connections until its endpoints are in, so only the moments with no process at all fail.
func TestProxyKilledRestartWindow(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 2)
	svc := n.createService(t, "web", webSpec(corev1.ServiceTypeClusterIP))
	n.setEndpoints(t, svc, 1, 2)
	first := n.startProxy(t)
	tg := targetsOf(t, svc)
	eventually(t, 30*time.Second, "the service never answered", func() error {
		if err := first.exited(); err != nil {
			return err
		}
		_, err := whoTCP(n.bed.Client, tg.clusterTCP)
		return err
	})

	type attempt struct {
		start, end time.Time
		err        error
	}
	stop := make(chan struct{})
	results := make(chan []attempt, 1)
	var made atomic.Int64
	go func() { // bounded: at most 30 s and 20,000 attempts
		var out []attempt
		deadline := time.Now().Add(30 * time.Second)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for len(out) < 20000 && time.Now().Before(deadline) {
			select {
			case <-stop:
				results <- out
				return
			case <-tick.C:
			}
			a := attempt{start: time.Now()}
			_, a.err = whoTCP(n.bed.Client, tg.clusterTCP)
			a.end = time.Now()
			out = append(out, a)
			made.Add(1)
		}
		results <- out
	}()

	madeAtLeast := func(what string, n int64) {
		eventually(t, 10*time.Second, what, func() error {
			if got := made.Load(); got < n {
				return fmt.Errorf("%d attempts, want %d", got, n)
			}
			return nil
		})
	}
	madeAtLeast("the prober never ran", 20)
	killed := time.Now()
	first.Kill()
	second := n.startProxy(t)
	restarted := time.Now()
	eventually(t, 30*time.Second, "traffic never came back after the restart", func() error {
		if err := second.exited(); err != nil {
			return err
		}
		_, err := whoTCP(n.bed.Client, tg.clusterTCP)
		return err
	})
	madeAtLeast("the prober never ran after the restart", made.Load()+50)
	close(stop)
	got := <-results

	var firstFail, lastFail attempt
	failures, after := 0, 0
	for _, a := range got {
		if a.start.After(killed) {
			after++
		}
		if a.err == nil {
			continue
		}
		if failures == 0 {
			firstFail = a
		}
		lastFail = a
		failures++
	}
	window := time.Duration(0)
	if failures > 0 {
		window = lastFail.end.Sub(firstFail.start)
	}
	t.Logf("SIGKILL at +0, restart started +%v: %d attempts after the kill, %d failed, refused window %v (last error: %v)",
		restarted.Sub(killed).Round(time.Millisecond), after, failures, window.Round(time.Millisecond), lastFail.err)
	if after < 20 {
		t.Fatalf("only %d attempts after the kill: the prober did not measure the restart", after)
	}
	// The kill itself ends what the old process served; the new one must pick up within a second.
	if window > time.Second {
		t.Errorf("clients saw failures for %v across the restart; want under 1s (the new process reopens the proxy ports first)", window)
	}
	if !strings.Contains(second.LogTail(1000), "Reopened the proxy sockets the portal rules in force point at") {
		t.Errorf("the restarted proxy did not say it reopened the proxy sockets; log:\n%s", second.LogTail(30))
	}
}
