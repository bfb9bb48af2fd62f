package e2e

// Address plan: internal/testbed's. The proxy and a real Prometheus run in the node namespace;
// Prometheus listens on the node namespace's own loopback (127.0.0.1:9090: the namespace is the
// test's, nothing else listens there) and scrapes the proxy's metrics on 127.0.0.1:10249. The
// client pod (172.30.0.2) sends TCP and UDP through the Service's cluster IP.

import (
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/child"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/deploy"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

const prometheusAddr = "127.0.0.1:9090"

// TestPrometheusScrapesTheProxy runs the chart's monitoring against a real Prometheus scraping a
// running proxy under traffic: every recording rule and every dashboard panel query returns data,
// no alert fires on the healthy proxy, and KubePortalProxySyncFailing fires when syncs are made to
// fail (iptables-restore fails while a file exists) and clears when they recover, and
// KubePortalProxyDown fires once the proxy stops. Those two alerts' "for" is set to 0 here
// (promtool's unit tests check the timing); their expressions are the file's.
// The proxy runs with the JSON access log, whose lines are checked against the documented schema.
func TestPrometheusScrapesTheProxy(t *testing.T) {
	t.Parallel()
	prom, err := exec.LookPath("prometheus")
	if err != nil {
		testenv.Unavailable(t, "prometheus not found (%v): hack/install-deps.sh monitoring", err)
	}
	root := repoRoot(t)
	n := newClusterNode(t, 2)
	svc := n.createAnnotated(t, "web", map[string]string{"portal-proxy.kubernetes.io/outlier-consecutive-failures": "3"},
		webSpec(corev1.ServiceTypeClusterIP))
	n.setEndpoints(t, svc, 1, 2)

	failFile, wrappers := restoreWrappers(t)
	proxy := startProxyEnv(t, n.bed.Node, n.dir, []string{"PATH=" + wrappers + ":" + os.Getenv("PATH")}, proxyArgs(
		"--kubeconfig="+n.kubeconfig, "--hostname-override="+n.name, "--access-log", "--log-format=json", "--udp-timeout=1s")...)
	tg := targetsOf(t, svc)
	proxy.waitAnswers(t, n.bed.Client, tg.clusterTCP, "the cluster IP portal never answered")

	rules, err := deploy.LoadRules(filepath.Join(root, deploy.RulesFile))
	if err != nil {
		t.Fatal(err)
	}
	startPrometheus(t, prom, n.bed.Node, n.dir, n.name, rules, "KubePortalProxySyncFailing", "KubePortalProxyDown")

	// Traffic: TCP requests and UDP exchanges through the cluster IP.
	for range 10 {
		if _, err := whoTCP(n.bed.Client, tg.clusterTCP); err != nil {
			t.Fatalf("TCP through %v: %v", tg.clusterTCP, err)
		}
		if _, err := whoUDP(n.bed.Client, tg.clusterUDP); err != nil {
			t.Fatalf("UDP through %v: %v", tg.clusterUDP, err)
		}
	}

	t.Run("every_recording_rule_returns_data", func(t *testing.T) {
		for _, rec := range rules.Records() {
			waitForResult(t, n.bed.Node, rec, true)
		}
	})
	t.Run("every_dashboard_query_returns_data", func(t *testing.T) {
		queries, err := deploy.DashboardQueries(filepath.Join(root, deploy.DashboardFile), deploy.GrafanaDefaults)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range queries {
			t.Run(strings.ReplaceAll(q.Panel, " ", "_")+"/"+q.RefID, func(t *testing.T) { waitForResult(t, n.bed.Node, q.Expr, true) })
		}
	})
	t.Run("no_alert_fires_on_a_healthy_proxy", func(t *testing.T) {
		// Pending counts too: an alert's expression must not hold, whatever its "for". The
		// informational ServicePortsRefused may: the proxy serves every Service of the shared API
		// server, and other tests' Services (or the API server's own) can lack endpoints.
		if res, err := promQuery(n.bed.Node, `ALERTS{severity!="info"}`); err != nil || len(res) > 0 {
			t.Errorf("alerts pending or firing on a healthy proxy: %s, %v", res, err)
		}
	})
	t.Run("access_log_lines_match_the_schema", func(t *testing.T) {
		checkAccessLog(t, filepath.Join(root, "proxier", "accesslog.schema.json"), proxy.LogPath)
	})

	t.Run("sync_failing_alert_fires_and_clears", func(t *testing.T) {
		const firing = `ALERTS{alertname="KubePortalProxySyncFailing",alertstate="firing"}`
		if err := os.WriteFile(failFile, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		// A new Service changes the rules: that sync and its retries fail.
		n.setEndpoints(t, n.createService(t, "other", webSpec(corev1.ServiceTypeClusterIP)), 1)
		waitForResult(t, n.bed.Node, firing, true)
		if err := os.Remove(failFile); err != nil {
			t.Fatal(err)
		}
		waitForResult(t, n.bed.Node, firing, false)
		waitForResult(t, n.bed.Node, `kube_portal_proxy_sync_failing == 0`, true)
	})

	t.Run("down_alert_fires_when_the_proxy_stops", func(t *testing.T) {
		if err := proxy.stop(); err != nil {
			t.Fatal(err)
		}
		waitForResult(t, n.bed.Node, `ALERTS{alertname="KubePortalProxyDown",alertstate="firing"}`, true)
	})
}

// restoreWrappers puts iptables-restore and ip6tables-restore in a directory for the proxy's PATH:
// each runs the real one, or fails while failFile exists (a broken iptables, seen from the proxy).
func restoreWrappers(t *testing.T) (failFile, dir string) {
	t.Helper()
	dir = t.TempDir()
	failFile = filepath.Join(dir, "fail")
	for _, tool := range []string{"iptables-restore", "ip6tables-restore"} {
		real, err := exec.LookPath(tool)
		if err != nil {
			real = "/usr/sbin/" + tool
		}
		script := fmt.Sprintf("#!/bin/sh\nif [ -e %q ]; then echo 'injected failure (e2e)' >&2; exit 1; fi\nexec %q \"$@\"\n", failFile, real)
		if err := os.WriteFile(filepath.Join(dir, tool), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return failFile, dir
}

// startPrometheus runs a real Prometheus in ns, scraping the proxy's metrics every second as the
// chart's ServiceMonitor would label them (job and node), with rules (the alerts named in
// immediate get "for: 0s"), evaluated every second. It stops when the test ends.
func startPrometheus(t *testing.T, bin string, ns *netns.NS, dir, node string, rules *deploy.RuleGroups, immediate ...string) {
	t.Helper()
	for gi := range rules.Groups {
		for ri, r := range rules.Groups[gi].Rules {
			for _, a := range immediate {
				if r.Alert == a {
					rules.Groups[gi].Rules[ri].For = "0s"
				}
			}
		}
	}
	rulesYAML, err := yaml.Marshal(rules)
	if err != nil {
		t.Fatal(err)
	}
	pdir := filepath.Join(dir, "prometheus")
	if err := os.MkdirAll(pdir, 0o755); err != nil {
		t.Fatal(err)
	}
	config := fmt.Sprintf(`global: {scrape_interval: 1s, scrape_timeout: 900ms, evaluation_interval: 1s}
rule_files: [rules.yaml]
scrape_configs:
- job_name: kube-portal-proxy
  static_configs:
  - targets: [%q]
    labels: {node: %q}
`, metricsAddr, node)
	for name, data := range map[string][]byte{"rules.yaml": rulesYAML, "prometheus.yml": []byte(config)} {
		if err := os.WriteFile(filepath.Join(pdir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("ip", "netns", "exec", ns.Name, bin,
		"--config.file="+filepath.Join(pdir, "prometheus.yml"), "--storage.tsdb.path="+filepath.Join(pdir, "data"),
		"--web.listen-address="+prometheusAddr, "--log.level=warn")
	p, err := child.Start("prometheus", cmd, filepath.Join(pdir, "prometheus.log"))
	if err != nil {
		t.Fatalf("start prometheus: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Stop(20 * time.Second); err != nil {
			t.Errorf("stop prometheus: %v", err)
		}
		if t.Failed() {
			t.Logf("prometheus log (last 30 lines):\n%s", p.LogTail(30))
		}
	})
	eventually(t, 60*time.Second, "Prometheus never became ready", func() error {
		if p.Exited() {
			return fmt.Errorf("prometheus exited: %v\n%s", p.Err(), p.LogTail(20))
		}
		code, body, err := httpGet(ns, "http://"+prometheusAddr+"/-/ready")
		if err != nil || code != 200 {
			return fmt.Errorf("/-/ready: %d %q %v", code, body, err)
		}
		return nil
	})
}

// promQuery runs an instant query from ns and returns the result vector.
func promQuery(ns *netns.NS, query string) ([]json.RawMessage, error) {
	code, body, err := httpGet(ns, "http://"+prometheusAddr+"/api/v1/query?query="+url.QueryEscape(query))
	if err != nil {
		return nil, err
	}
	var resp struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string            `json:"resultType"`
			Result     []json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &resp); err != nil {
		return nil, fmt.Errorf("query %s: HTTP %d %q: %w", query, code, body, err)
	}
	if resp.Status != "success" {
		return nil, fmt.Errorf("query %s: %s", query, resp.Error)
	}
	return resp.Data.Result, nil
}

// waitForResult waits until query returns some series (want) or none (!want).
func waitForResult(t *testing.T, ns *netns.NS, query string, want bool) {
	t.Helper()
	what := "no data for " + query
	if !want {
		what = "still data for " + query
	}
	eventually(t, 60*time.Second, what, func() error {
		res, err := promQuery(ns, query)
		switch {
		case err != nil:
			return err
		case want && len(res) == 0:
			return fmt.Errorf("empty result")
		case !want && len(res) > 0:
			return fmt.Errorf("result %s", res)
		}
		return nil
	})
}

// checkAccessLog validates the access log lines of the proxy's log (JSON) against the schema,
// waiting for a TCP and a UDP line.
func checkAccessLog(t *testing.T, schemaFile, logFile string) {
	t.Helper()
	schema, err := testenv.LoadJSONSchema(schemaFile)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	eventually(t, 30*time.Second, "no TCP and UDP access log lines", func() error {
		data, err := os.ReadFile(logFile)
		if err != nil {
			return err
		}
		lines = lines[:0]
		kinds := map[string]bool{}
		for _, l := range strings.Split(string(data), "\n") {
			if strings.Contains(l, `"access":"tcp"`) || strings.Contains(l, `"access":"udp"`) {
				lines = append(lines, l)
				kinds[l[strings.Index(l, `"access":"`)+10:][:3]] = true
			}
		}
		if !kinds["tcp"] || !kinds["udp"] {
			return fmt.Errorf("access lines by protocol: %v", kinds)
		}
		return nil
	})
	for _, l := range lines {
		if err := schema.Validate([]byte(l)); err != nil {
			t.Errorf("a real access log line does not match the schema: %v", err)
		}
	}
}

// repoRoot is the repository's root (go test runs in e2e/).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := deploy.RepoRoot(".")
	if err != nil {
		t.Fatal(err)
	}
	return root
}
