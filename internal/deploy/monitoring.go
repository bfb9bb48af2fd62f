package deploy

// monitoring.go reads the chart's Prometheus rules and Grafana dashboard, so tests can check them
// with promtool and run every query against a real Prometheus.

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

// The monitoring files of the chart, relative to the repository root.
const (
	RulesFile     = ChartPath + "/files/prometheus-rules.yaml"
	RulesTestFile = ChartPath + "/ci/prometheus-rules_test.yaml"
	DashboardFile = ChartPath + "/files/grafana-dashboard.json"
)

// RuleGroups is a Prometheus rules file.
type RuleGroups struct {
	Groups []RuleGroup `json:"groups"`
}

// RuleGroup is one group of a rules file.
type RuleGroup struct {
	Name  string `json:"name"`
	Rules []Rule `json:"rules"`
}

// Rule is a recording rule (Record set) or an alert (Alert set).
type Rule struct {
	Record      string            `json:"record,omitempty"`
	Alert       string            `json:"alert,omitempty"`
	Expr        string            `json:"expr"`
	For         string            `json:"for,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// LoadRules reads a rules file strictly (an unknown field is an error).
func LoadRules(file string) (*RuleGroups, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var g RuleGroups
	if err := yaml.UnmarshalStrict(data, &g); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return &g, nil
}

// Records are the recording rules' names, Alerts the alerts' names, in file order.
func (g *RuleGroups) Records() []string { return g.names(func(r Rule) string { return r.Record }) }

// Alerts are the alerts' names, in file order.
func (g *RuleGroups) Alerts() []string { return g.names(func(r Rule) string { return r.Alert }) }

func (g *RuleGroups) names(f func(Rule) string) []string {
	var out []string
	for _, grp := range g.Groups {
		for _, r := range grp.Rules {
			if n := f(r); n != "" {
				out = append(out, n)
			}
		}
	}
	return out
}

// PanelQuery is one query of a dashboard panel.
type PanelQuery struct {
	Panel string // the panel's title
	RefID string
	Expr  string
}

type dashboard struct {
	Panels []struct {
		Title   string `json:"title"`
		Type    string `json:"type"`
		Targets []struct {
			RefID string `json:"refId"`
			Expr  string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name string `json:"name"`
		} `json:"list"`
	} `json:"templating"`
}

// GrafanaDefaults are the values Grafana gives the dashboard's variables with "All" selected,
// and a rate interval (Grafana's is at least four scrape intervals).
var GrafanaDefaults = map[string]string{"datasource": "", "node": ".*", "service_port": ".*", "__rate_interval": "1m"}

// dashboardVar matches Grafana's variable references: $name, ${name} and ${name:format}.
var dashboardVar = regexp.MustCompile(`\$\{(\w+)(?::\w+)?\}|\$(\w+)`)

// DashboardQueries returns every panel's queries with the variables replaced by vars (Grafana's
// own, such as __rate_interval, included). A reference to a variable missing from vars is an
// error, so a query that Grafana would fill in and the test would not is caught.
func DashboardQueries(file string, vars map[string]string) ([]PanelQuery, error) {
	d, err := loadDashboard(file)
	if err != nil {
		return nil, err
	}
	var out []PanelQuery
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			return nil, fmt.Errorf("%s: panel %q has no query", file, p.Title)
		}
		for _, tg := range p.Targets {
			var missing []string
			expr := dashboardVar.ReplaceAllStringFunc(tg.Expr, func(ref string) string {
				m := dashboardVar.FindStringSubmatch(ref)
				name := m[1] + m[2]
				v, ok := vars[name]
				if !ok {
					missing = append(missing, name)
				}
				return v
			})
			if len(missing) > 0 {
				sort.Strings(missing)
				return nil, fmt.Errorf("%s: panel %q query %s uses variables without a value: %s", file, p.Title, tg.RefID, strings.Join(missing, ", "))
			}
			out = append(out, PanelQuery{Panel: p.Title, RefID: tg.RefID, Expr: expr})
		}
	}
	return out, nil
}

func loadDashboard(file string) (*dashboard, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return &d, nil
}

// DashboardVariables are the names of the dashboard's template variables.
func DashboardVariables(file string) ([]string, error) {
	d, err := loadDashboard(file)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, v := range d.Templating.List {
		out = append(out, v.Name)
	}
	return out, nil
}
