package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// The monitoring tests run the real promtool (Debian's prometheus package; hack/install-deps.sh
// monitoring): they skip without it, and fail under KPP_E2E_REQUIRE=1. The e2e suite runs the
// same rules and dashboard queries against a real Prometheus scraping a running proxy.

const repoRoot = "../.."

func requirePromtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		testenv.Unavailable(t, "promtool not found (%v): hack/install-deps.sh monitoring (Debian package prometheus)", err)
	}
	return p
}

func promtool(t *testing.T, promtool, dir string, args ...string) {
	t.Helper()
	cmd := exec.CommandContext(helmContext(t), promtool, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// TestPrometheusRules checks the rules file with promtool and runs its unit tests, and checks
// that every alert has a unit test.
func TestPrometheusRules(t *testing.T) {
	t.Parallel()
	pt := requirePromtool(t)
	chart := filepath.Join(repoRoot, ChartPath)
	promtool(t, pt, chart, "check", "rules", "files/prometheus-rules.yaml")
	promtool(t, pt, chart, "test", "rules", "ci/prometheus-rules_test.yaml")

	rules, err := LoadRules(filepath.Join(repoRoot, RulesFile))
	if err != nil {
		t.Fatal(err)
	}
	alerts := rules.Alerts()
	if len(alerts) == 0 || len(rules.Records()) == 0 {
		t.Fatalf("rules file has %d alerts and %d recording rules", len(alerts), len(rules.Records()))
	}

	t.Run("every_alert_has_a_unit_test", func(t *testing.T) {
		var tests struct {
			Tests []struct {
				AlertRuleTest []struct {
					Alertname string `json:"alertname"`
					ExpAlerts []any  `json:"exp_alerts"`
				} `json:"alert_rule_test"`
			} `json:"tests"`
		}
		if err := yaml.Unmarshal([]byte(readFile(t, filepath.Join(repoRoot, RulesTestFile))), &tests); err != nil {
			t.Fatal(err)
		}
		fires := map[string]bool{}
		for _, tc := range tests.Tests {
			for _, a := range tc.AlertRuleTest {
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname] = true
				}
			}
		}
		for _, a := range alerts {
			if !fires[a] {
				t.Errorf("alert %s has no promtool test in which it fires", a)
			}
		}
	})
}

// runbookFile holds the alerts' runbooks, one heading per alert; runbookURL is where an alert's
// runbook_url points: the heading's anchor in that file on GitHub.
const (
	runbookFile = "docs/monitoring.md"
	runbookURL  = "https://github.com/kube-portal-proxy/kube-portal-proxy/blob/main/" + runbookFile + "#"
)

// TestAlertRunbooks checks that every alert has a runbook: a heading named after it in
// docs/monitoring.md, which its runbook_url anchors, and a summary, description and severity.
// (The anchor is the heading's as GitHub renders it: the name lower-cased.)
func TestAlertRunbooks(t *testing.T) {
	t.Parallel()
	rules, err := LoadRules(filepath.Join(repoRoot, RulesFile))
	if err != nil {
		t.Fatal(err)
	}
	if len(rules.Alerts()) == 0 {
		t.Fatal("rules file has no alerts")
	}
	runbooks := readFile(t, filepath.Join(repoRoot, runbookFile))
	for _, r := range rules.Groups {
		for _, rule := range r.Rules {
			if rule.Alert == "" {
				continue
			}
			if !regexp.MustCompile(`(?m)^#+ ` + rule.Alert + `$`).MatchString(runbooks) {
				t.Errorf("%s has no heading %q (the runbook)", runbookFile, rule.Alert)
			}
			if got, want := rule.Annotations["runbook_url"], runbookURL+strings.ToLower(rule.Alert); got != want {
				t.Errorf("alert %s runbook_url %q, want %q", rule.Alert, got, want)
			}
			for _, k := range []string{"summary", "description"} {
				if rule.Annotations[k] == "" {
					t.Errorf("alert %s has no %s", rule.Alert, k)
				}
			}
			if rule.Labels["severity"] == "" {
				t.Errorf("alert %s has no severity", rule.Alert)
			}
		}
	}
}

// TestDashboardQueriesParse checks the dashboard: every panel has queries, the variables are the
// documented ones, and every query is valid PromQL (promtool checks them as recording rules) that
// selects the proxy's job.
func TestDashboardQueriesParse(t *testing.T) {
	t.Parallel()
	file := filepath.Join(repoRoot, DashboardFile)
	vars, err := DashboardVariables(file)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"datasource", "node", "service_port"}; !slices.Equal(vars, want) {
		t.Errorf("dashboard variables %v, want %v", vars, want)
	}
	queries, err := DashboardQueries(file, GrafanaDefaults)
	if err != nil {
		t.Fatal(err)
	}
	var rules RuleGroups
	rules.Groups = append(rules.Groups, RuleGroup{Name: "dashboard"})
	for i, q := range queries {
		if !strings.Contains(q.Expr, `job="kube-portal-proxy"`) {
			t.Errorf("panel %q query %s selects no job=\"kube-portal-proxy\": %s", q.Panel, q.RefID, q.Expr)
		}
		rules.Groups[0].Rules = append(rules.Groups[0].Rules, Rule{Record: fmt.Sprintf("dashboard:query_%d", i), Expr: q.Expr})
	}
	if t.Failed() {
		return
	}
	pt := requirePromtool(t)
	data, err := yaml.Marshal(rules)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "dashboard-queries.yaml")
	if err := os.WriteFile(f, data, 0o644); err != nil {
		t.Fatal(err)
	}
	promtool(t, pt, "", "check", "rules", f)
}
