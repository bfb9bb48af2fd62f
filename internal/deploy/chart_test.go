package deploy

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// The chart tests run the real helm (hack/install-deps.sh monitoring installs it): they skip
// without it, and fail under KPP_E2E_REQUIRE=1.

const (
	repoChart  = "../../" + ChartPath
	fullValues = repoChart + "/ci/full-values.yaml"
)

func requireHelm(t *testing.T) string {
	t.Helper()
	h, err := HelmBinary()
	if err != nil {
		testenv.Unavailable(t, "helm not found (%v): hack/install-deps.sh monitoring, or set %s", err, EnvHelm)
	}
	return h
}

func helmContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// TestChartLint runs helm lint --strict with the default values and with a file that sets every
// value away from its default.
func TestChartLint(t *testing.T) {
	t.Parallel()
	helm := requireHelm(t)
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"default_values", nil},
		{"full_values", []string{"-f", fullValues}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := exec.CommandContext(helmContext(t), helm, append([]string{"lint", "--strict", repoChart}, tc.args...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("helm lint: %v\n%s", err, out)
			}
			if strings.Contains(string(out), "[WARNING]") || strings.Contains(string(out), "[ERROR]") {
				t.Errorf("helm lint reports problems:\n%s", out)
			}
		})
	}
}

// chartOnlyLabels are the labels the chart adds to deploy/'s: Helm's bookkeeping. The pod's
// checksum/config annotation rolls the pods when the configuration changes (kubectl apply -k users
// restart by hand).
var (
	chartOnlyLabels      = []string{"app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version", "helm.sh/chart"}
	chartOnlyAnnotations = []string{"checksum/config"}
)

// TestChartDefaultsMatchDeploy keeps deploy/ (kubectl apply -k) and the chart from drifting: the
// chart with its default values, installed as release kube-portal-proxy in kube-system, renders
// the same four objects, but for Helm's labels; the configuration files say the same thing
// (deploy/'s has comments). deploy/ stays hand-written because its comments are the
// documentation of every setting for kustomize users; this test is what ties the two.
func TestChartDefaultsMatchDeploy(t *testing.T) {
	t.Parallel()
	helm := requireHelm(t)
	want, err := Load(repoDeploy)
	if err != nil {
		t.Fatal(err)
	}
	got, err := Render(helmContext(t), helm, repoChart, "kube-portal-proxy", "kube-system")
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Extra) > 0 {
		names := []string{}
		for _, o := range got.Extra {
			names = append(names, o.GetKind()+"/"+o.GetName())
		}
		t.Errorf("default values render objects deploy/ does not have: %v (monitoring must be off by default)", names)
	}
	for _, meta := range []map[string]string{got.ServiceAccount.Labels, got.ClusterRoleBinding.Labels, got.ConfigMap.Labels, got.DaemonSet.Labels} {
		for _, l := range chartOnlyLabels {
			if _, ok := meta[l]; !ok {
				t.Errorf("rendered object lacks label %s", l)
			}
			delete(meta, l)
		}
	}
	for _, a := range chartOnlyAnnotations {
		if _, ok := got.DaemonSet.Spec.Template.Annotations[a]; !ok {
			t.Errorf("rendered pod template lacks annotation %s", a)
		}
		delete(got.DaemonSet.Spec.Template.Annotations, a)
	}
	if len(got.DaemonSet.Spec.Template.Annotations) == 0 {
		got.DaemonSet.Spec.Template.Annotations = nil
	}

	for _, c := range []struct {
		kind      string
		want, got any
	}{
		{"ServiceAccount", want.ServiceAccount, got.ServiceAccount},
		{"ClusterRoleBinding", want.ClusterRoleBinding, got.ClusterRoleBinding},
		{"DaemonSet", want.DaemonSet, got.DaemonSet},
	} {
		if diff := cmp.Diff(c.want, c.got); diff != "" {
			t.Errorf("%s: deploy/ and the chart's defaults differ (-deploy +chart):\n%s", c.kind, diff)
		}
	}

	wantCM, gotCM := want.ConfigMap.DeepCopy(), got.ConfigMap.DeepCopy()
	wantConf, gotConf := parseYAML(t, wantCM.Data["config.conf"]), parseYAML(t, gotCM.Data["config.conf"])
	if diff := cmp.Diff(wantConf, gotConf); diff != "" {
		t.Errorf("config.conf: deploy/ and the chart's defaults differ (-deploy +chart):\n%s", diff)
	}
	wantCM.Data, gotCM.Data = nil, nil
	if diff := cmp.Diff(wantCM, gotCM); diff != "" {
		t.Errorf("ConfigMap: deploy/ and the chart's defaults differ (-deploy +chart):\n%s", diff)
	}
}

func parseYAML(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := yaml.Unmarshal([]byte(s), &m); err != nil {
		t.Fatalf("%v in:\n%s", err, s)
	}
	return m
}

// TestChartFullValues renders every value set (ci/full-values.yaml) and checks that each reaches
// the pod: flags, config fields, the hand-over host path, the scrape and rules objects. That the
// proxy accepts the result is daemon's TestChartValuesReachTheProxy.
func TestChartFullValues(t *testing.T) {
	t.Parallel()
	helm := requireHelm(t)
	r, err := Render(helmContext(t), helm, repoChart, "kpp", "kube-system", "-f", fullValues)
	if err != nil {
		t.Fatal(err)
	}
	c, err := r.Container()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--portal-mode=bind", "--portal-interface=kpp0", "--default-data-path=proxy", "--io-engine=epoll",
		"--udp-max-sessions=2048", "--tcp-idle-timeout=1h", "--log-level=debug", "--access-log", "--protect-proxy-ports=false",
		"--drain-removed-endpoints", "--iptables-variant=nft", "--shutdown-timeout=20s", "--kube-api-qps=25",
		"--handover-socket=/var/run/kube-portal-proxy/handover.sock", "--metrics-only-bind-address=0.0.0.0:10251"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("args %q lack %s", c.Args, want)
		}
	}
	conf, err := r.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	gotConf := parseYAML(t, conf)
	for _, f := range []struct {
		path string
		want any
	}{
		{"clusterCIDR", "10.244.0.0/16,fd00:10:244::/56"},
		{"portRange", "40000-40999"},
		{"nodePortAddresses", []any{"192.0.2.0/24", "2001:db8::/64"}},
		{"logging.format", "json"},
		{"metricsBindAddress", "127.0.0.1:10259"},
		{"enableProfiling", true},
		{"iptables.syncPeriod", "1m"},
		{"conntrack.min", float64(262144)},
		{"clientConnection.qps", float64(20)},
	} {
		if got := lookup(gotConf, f.path); !cmp.Equal(got, f.want) {
			t.Errorf("config.conf %s = %#v, want %#v", f.path, got, f.want)
		}
	}
	pod := r.DaemonSet.Spec.Template.Spec
	if i := slices.IndexFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == "run" }); i < 0 || pod.Volumes[i].HostPath == nil || pod.Volumes[i].HostPath.Path != "/run/kpp" {
		t.Errorf("the hand-over volume is not hostPath /run/kpp: %+v", pod.Volumes)
	}
	if pod.PriorityClassName != "system-cluster-critical" || c.Image != "registry.example.com/kpp/kube-portal-proxy:v1.2.3" || !*c.SecurityContext.Privileged {
		t.Errorf("priorityClassName %q, image %q, privileged %v", pod.PriorityClassName, c.Image, *c.SecurityContext.Privileged)
	}
	if c.LivenessProbe.HTTPGet.Port.IntValue() != 10266 {
		t.Errorf("liveness probe port %v, want healthzBindAddress's 10266", c.LivenessProbe.HTTPGet.Port)
	}

	svc := r.Find("Service", "kpp-kube-portal-proxy-metrics")
	sm := r.Find("ServiceMonitor", "kpp-kube-portal-proxy")
	rule := r.Find("PrometheusRule", "kpp-kube-portal-proxy")
	dash := r.Find("ConfigMap", "kpp-kube-portal-proxy-dashboard")
	if svc == nil || sm == nil || rule == nil || dash == nil {
		t.Fatalf("monitoring objects missing: service %v, servicemonitor %v, rule %v, dashboard %v", svc != nil, sm != nil, rule != nil, dash != nil)
	}
	if port, _, _ := unstructured.NestedSlice(svc.Object, "spec", "ports"); len(port) != 1 || port[0].(map[string]any)["targetPort"] != float64(10251) {
		t.Errorf("metrics Service ports %v, want targetPort 10251 (metricsOnlyBindAddress)", port)
	}
	if dash.GetNamespace() != "monitoring" || dash.GetLabels()["grafana_dashboard"] != "1" {
		t.Errorf("dashboard ConfigMap in %q with labels %v", dash.GetNamespace(), dash.GetLabels())
	}

	// The PrometheusRule carries the rules file unchanged, and the dashboard ConfigMap the
	// dashboard.
	wantRules := parseYAML(t, readFile(t, repoChart+"/files/prometheus-rules.yaml"))
	gotRules := rule.Object["spec"]
	if diff := cmp.Diff(normalizeJSON(t, wantRules), normalizeJSON(t, gotRules)); diff != "" {
		t.Errorf("PrometheusRule spec differs from files/prometheus-rules.yaml (-file +rendered):\n%s", diff)
	}
	data, _, _ := unstructured.NestedStringMap(dash.Object, "data")
	var gotDash, wantDash any
	if err := json.Unmarshal([]byte(data["kube-portal-proxy.json"]), &gotDash); err != nil {
		t.Fatalf("dashboard ConfigMap: %v", err)
	}
	if err := json.Unmarshal([]byte(readFile(t, repoChart+"/files/grafana-dashboard.json")), &wantDash); err != nil {
		t.Fatal(err)
	}
	if !cmp.Equal(wantDash, gotDash) {
		t.Error("the dashboard ConfigMap does not hold files/grafana-dashboard.json")
	}
}

// TestChartSchemaRejectsBadValues: values.schema.json (and the template's own check) fail the
// install with a message naming the value.
func TestChartSchemaRejectsBadValues(t *testing.T) {
	t.Parallel()
	helm := requireHelm(t)
	for _, tc := range []struct {
		name    string
		set     []string
		wantErr string
	}{
		{"unknown_portal_mode", []string{"proxy.portalMode=nat"}, "at '/proxy/portalMode': value must be one of 'iptables', 'bind'"},
		{"misspelt_key", []string{"proxy.portalmode=bind"}, "at '/proxy': additional properties 'portalmode' not allowed"},
		{"misspelt_top_level_key", []string{"tolerration=x"}, "additional properties 'tolerration' not allowed"},
		{"unknown_data_path", []string{"proxy.defaultDataPath=fast"}, "at '/proxy/defaultDataPath': value must be one of '', 'kernel', 'proxy'"},
		{"unknown_io_engine", []string{"proxy.ioEngine=uring"}, "at '/proxy/ioEngine'"},
		{"log_format", []string{"proxy.logFormat=xml"}, "at '/proxy/logFormat': value must be one of 'text', 'json'"},
		{"duration_without_unit", []string{"proxy.syncPeriod=30"}, "at '/proxy/syncPeriod': got number, want string"},
		{"malformed_duration", []string{"proxy.minSyncPeriod=1 second"}, "at '/proxy/minSyncPeriod'"},
		{"port_range", []string{"proxy.proxyPortRange=ports"}, "at '/proxy/proxyPortRange'"},
		{"node_port_address_not_a_cidr", []string{"proxy.nodePortAddresses={primary}"}, "at '/proxy/nodePortAddresses/0'"},
		{"cluster_cidr", []string{"proxy.clusterCIDR=pods"}, "at '/proxy/clusterCIDR'"},
		{"metrics_address_without_port", []string{"proxy.metricsBindAddress=0.0.0.0"}, "at '/proxy/metricsBindAddress'"},
		{"metrics_only_address_without_port", []string{"proxy.metricsOnlyBindAddress=0.0.0.0"}, "at '/proxy/metricsOnlyBindAddress'"},
		{"relative_handover_path", []string{"handover.hostPath=run/kpp"}, "at '/handover/hostPath'"},
		{"oom_score_out_of_range", []string{"proxy.oomScoreAdj=-2000"}, "at '/proxy/oomScoreAdj'"},
		{"extra_arg_not_a_flag", []string{"proxy.extraArgs={bind}"}, "at '/proxy/extraArgs/0'"},
		{"service_monitor_without_metrics_only_address", []string{"monitoring.serviceMonitor.enabled=true", "proxy.metricsBindAddress=0.0.0.0:10249"},
			`monitoring.serviceMonitor.enabled needs proxy.metricsOnlyBindAddress reachable by Prometheus (e.g. 0.0.0.0:10251), which serves /metrics alone; it is ""`},
		{"service_monitor_on_loopback_metrics_only", []string{"monitoring.serviceMonitor.enabled=true", "proxy.metricsOnlyBindAddress=127.0.0.1:10251"},
			`it is "127.0.0.1:10251" (loopback or disabled)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var args []string
			for _, s := range tc.set {
				args = append(args, "--set", s)
			}
			_, err := RenderYAML(helmContext(t), helm, repoChart, "kube-portal-proxy", "kube-system", args...)
			if err == nil {
				t.Fatalf("helm template --set %v succeeded; want an error containing %q", tc.set, tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("error %v\nwant it to contain %q", err, tc.wantErr)
			}
		})
	}
}

func lookup(m map[string]any, path string) any {
	var cur any = m
	for _, k := range strings.Split(path, ".") {
		mm, ok := cur.(map[string]any)
		if !ok {
			return nil
		}
		cur = mm[k]
	}
	return cur
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.FromSlash(p))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// normalizeJSON makes YAML-decoded values comparable whatever decoder read them (int64 vs float64).
func normalizeJSON(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}
