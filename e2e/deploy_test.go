package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/deploy"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestDeployManifestsServerDryRun applies deploy/ with kubectl's kustomize support against the
// real API server in server-side dry run: every object passes the server's defaulting,
// validation (strict: an unknown field fails) and admission, and nothing is stored.
func TestDeployManifestsServerDryRun(t *testing.T) {
	t.Parallel()
	requireKubectl(t)
	dir := deployDir(t)
	m := loadManifests(t, dir)

	admin := adminClient(t)
	// The API server's system namespaces controller creates kube-system shortly after /readyz
	// says ok, not before: wait for the namespaces the objects live in.
	for _, ns := range []string{m.ServiceAccount.Namespace, m.ConfigMap.Namespace, m.DaemonSet.Namespace} {
		eventually(t, 30*time.Second, "namespace "+ns+" never appeared", func() error {
			_, err := admin.CoreV1().Namespaces().Get(t.Context(), ns, metav1.GetOptions{})
			return err
		})
	}

	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	out, err := controlPlane.Kubectl(ctx, "apply", "--dry-run=server", "--validate=strict", "-k", dir)
	if err != nil {
		t.Fatal(err) // the error carries kubectl's output
	}

	// kubectl prints one line per object, and any warning of the server (a deprecated field or
	// API) on a line of its own: the manifests must draw none.
	want := []string{
		"serviceaccount/" + m.ServiceAccount.Name + " created (server dry run)",
		"clusterrolebinding.rbac.authorization.k8s.io/" + m.ClusterRoleBinding.Name + " created (server dry run)",
		"configmap/" + m.ConfigMap.Name + " created (server dry run)",
		"daemonset.apps/" + m.DaemonSet.Name + " created (server dry run)",
	}
	got := strings.Split(strings.TrimSpace(string(out)), "\n")
	slices.Sort(want)
	slices.Sort(got)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("kubectl apply --dry-run=server -k %s output lines (-want +got):\n%s", dir, diff)
	}

	// A dry run stores nothing.
	_, err = admin.AppsV1().DaemonSets(m.DaemonSet.Namespace).Get(t.Context(), m.DaemonSet.Name, metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		t.Errorf("get daemonset %s/%s after the dry run: err = %v, want NotFound", m.DaemonSet.Namespace, m.DaemonSet.Name, err)
	}
}

// TestDaemonSetArgsServeAService runs the binary as the DaemonSet does on a node: exactly the
// container's args (the downward API's node name expanded) and the ConfigMap's config file. The
// only addition is --kubeconfig, since the file's empty kubeconfig means in-cluster
// configuration and there is no pod here. The proxy runs in the test's node namespace, never in
// the root one.
func TestDaemonSetArgsServeAService(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 3)
	m := loadManifests(t, deployDir(t))

	config, err := m.ConfigFile()
	if err != nil {
		t.Fatalf("config file of deploy/: %v", err)
	}
	configPath := filepath.Join(n.dir, "config.conf")
	if err := os.WriteFile(configPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	args, err := m.LocalArgs(n.name, configPath)
	if err != nil {
		t.Fatalf("DaemonSet args: %v", err)
	}

	// The config may ask for conntrack sysctls (nf_conntrack_max is host-wide): the proxy must
	// run in the node namespace, and the root namespace's values must not move.
	rootNS := namespaceID(t, "/proc/self/ns/net")
	if node := namespaceID(t, "/run/netns/"+n.bed.Node.Name); node == rootNS {
		t.Fatalf("node namespace %s is the root network namespace; refusing to start the proxy", n.bed.Node.Name)
	}
	rootBefore := readConntrackSysctls(t, nil)
	nodeBefore := readConntrackSysctls(t, n.bed.Node)

	svc := n.createService(t, "web", webSpec(corev1.ServiceTypeNodePort, externalIP()))
	n.setEndpoints(t, svc, 1, 2, 3)
	proxy := startProxy(t, n.bed.Node, n.dir, append(args, "--kubeconfig="+n.kubeconfig)...)

	// The config's health (0.0.0.0:10256) and metrics (127.0.0.1:10249) addresses are the ones
	// checkTraffic queries on the node's loopback.
	checkTraffic(t, n.bed, proxy, targetsOf(t, svc), podNames(1, 2, 3))

	t.Run("the_DaemonSet_probes_pass", func(t *testing.T) {
		c, err := m.Container()
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range []struct {
			kind  string
			probe *corev1.Probe
		}{{"liveness", c.LivenessProbe}, {"readiness", c.ReadinessProbe}} {
			url, err := probeURL(c, p.probe)
			if err != nil {
				t.Errorf("%s probe: %v", p.kind, err)
				continue
			}
			// The kubelet runs on the node and probes the pod IP, the node's IP with hostNetwork.
			code, body, err := httpGet(n.bed.Node, url)
			if err != nil || code != http.StatusOK {
				t.Errorf("%s probe GET %s = %d %q, %v; want 200", p.kind, url, code, body, err)
			}
		}
	})
	t.Run("the_proxy_runs_in_the_node_namespace", func(t *testing.T) {
		proc := namespaceID(t, fmt.Sprintf("/proc/%d/ns/net", proxy.Pid()))
		if node := namespaceID(t, "/run/netns/"+n.bed.Node.Name); proc != node {
			t.Errorf("proxy pid %d network namespace %v, want the node namespace %v (root is %v)",
				proxy.Pid(), proc, node, rootNS)
		}
	})
	t.Run("conntrack_sysctls_are_left_as_they_were", func(t *testing.T) {
		// The ConfigMap sets the conntrack options to 0 (an unprivileged pod cannot write
		// /proc/sys), so the proxy touches none; the flags' defaults would have set some.
		if diff := cmp.Diff(nodeBefore, readConntrackSysctls(t, n.bed.Node)); diff != "" {
			t.Errorf("node namespace conntrack sysctls changed (-before +after):\n%s", diff)
		}
		if diff := cmp.Diff(rootBefore, readConntrackSysctls(t, nil)); diff != "" {
			t.Errorf("ROOT namespace conntrack sysctls changed (-before +after):\n%s", diff)
		}
	})
}

// requireKubectl skips t unless the control plane runs and kubectl was found with it (it fails
// instead when the whole suite is required to run).
func requireKubectl(t *testing.T) {
	t.Helper()
	requireControlPlane(t)
	if controlPlane.Binaries.Kubectl == "" {
		testenv.Unavailable(t, "e2e skipped: kubectl missing (set %s or run hack/controlplane-build.sh)", framework.EnvKubectl)
	}
}

// deployDir is the repository's deploy/ directory (go test runs in e2e/).
func deployDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("..", "deploy"))
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func loadManifests(t *testing.T, dir string) *deploy.Manifests {
	t.Helper()
	m, err := deploy.Load(dir)
	if err != nil {
		t.Fatalf("load %s: %v", dir, err)
	}
	return m
}

// probeURL is the URL the kubelet requests for an HTTP probe of the proxy's pod: the pod IP
// (with hostNetwork, the node IP the Node object lists) unless the probe names a host, and the
// port by number or by the container port's name.
func probeURL(c *corev1.Container, p *corev1.Probe) (string, error) {
	if p == nil || p.HTTPGet == nil {
		return "", fmt.Errorf("container %s has no HTTP probe", c.Name)
	}
	g := p.HTTPGet
	port := g.Port.IntValue()
	if name := g.Port.StrVal; name != "" {
		port = 0
		for _, cp := range c.Ports {
			if cp.Name == name {
				port = int(cp.ContainerPort)
			}
		}
	}
	if port == 0 {
		return "", fmt.Errorf("container %s: probe port %s is neither a number nor a container port's name", c.Name, g.Port.String())
	}
	host := testbed.NodeExtIP.String()
	if g.Host != "" {
		host = g.Host
	}
	scheme := strings.ToLower(string(g.Scheme))
	if scheme == "" {
		scheme = "http"
	}
	return scheme + "://" + net.JoinHostPort(host, strconv.Itoa(port)) + g.Path, nil
}

// nsID identifies a network namespace: the device and inode of its nsfs file.
type nsID struct{ Dev, Ino uint64 }

func namespaceID(t *testing.T, path string) nsID {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatalf("network namespace %s: %v", path, err)
	}
	return nsID{Dev: st.Dev, Ino: st.Ino}
}

// conntrackSysctls are the sysctls under /proc/sys/net/netfilter the proxy's --conntrack-*
// options write.
var conntrackSysctls = []string{
	"nf_conntrack_max",
	"nf_conntrack_tcp_timeout_established",
	"nf_conntrack_tcp_timeout_close_wait",
	"nf_conntrack_tcp_be_liberal",
	"nf_conntrack_udp_timeout",
	"nf_conntrack_udp_timeout_stream",
}

// readConntrackSysctls reads the conntrack sysctls in ns, or in this process's (root) namespace
// when ns is nil. A sysctl that cannot be read (nf_conntrack not loaded) is recorded as such.
func readConntrackSysctls(t *testing.T, ns *netns.NS) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, name := range conntrackSysctls {
		path := "/proc/sys/net/netfilter/" + name
		var b []byte
		var err error
		if ns == nil {
			b, err = os.ReadFile(path)
		} else {
			b, err = ns.Exec(t.Context(), "cat", path)
		}
		if err != nil {
			out[name] = "unreadable"
			continue
		}
		out[name] = strings.TrimSpace(string(b))
	}
	return out
}

// TestChartServerDryRun renders the Helm chart with its default values and with every value set
// (ci/full-values.yaml), and applies each to the real API server in server-side dry run, strictly,
// as deploy/ is above: every object passes defaulting, validation and admission, without a
// warning. The Prometheus Operator objects (ServiceMonitor, PrometheusRule) are left out: this API
// server has no monitoring.coreos.com CRDs. The rules they carry are promtool-checked, and the
// chart test compares them with the rules file.
func TestChartServerDryRun(t *testing.T) {
	t.Parallel()
	requireKubectl(t)
	helm, err := deploy.HelmBinary()
	if err != nil {
		testenv.Unavailable(t, "helm not found (%v): hack/install-deps.sh monitoring, or set %s", err, deploy.EnvHelm)
	}
	chart := filepath.Join(repoRoot(t), deploy.ChartPath)
	admin := adminClient(t)
	eventually(t, 30*time.Second, "namespace kube-system never appeared", func() error {
		_, err := admin.CoreV1().Namespaces().Get(t.Context(), "kube-system", metav1.GetOptions{})
		return err
	})
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"default_values", nil},
		// The dashboard's namespace would have to exist: keep it in the release's. This API server
		// runs without --allow-privileged (kubeadm's has it), so the pod stays unprivileged.
		{"full_values", []string{"-f", filepath.Join(chart, "ci", "full-values.yaml"), "--set", "monitoring.dashboard.namespace=",
			"--set", "securityContext.privileged=false"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			r, err := deploy.Render(ctx, helm, chart, "kube-portal-proxy", "kube-system", tc.args...)
			if err != nil {
				t.Fatal(err)
			}
			var docs []string
			var want []string
			for _, d := range deploy.SplitDocuments(r.YAML) {
				var obj struct {
					APIVersion string `json:"apiVersion"`
					Kind       string `json:"kind"`
					Metadata   struct {
						Name string `json:"name"`
					} `json:"metadata"`
				}
				if err := yaml.Unmarshal(d, &obj); err != nil {
					t.Fatal(err)
				}
				if obj.Kind == "" || strings.HasPrefix(obj.APIVersion, "monitoring.coreos.com/") {
					continue
				}
				docs = append(docs, string(d))
				group := ""
				if g, _, ok := strings.Cut(obj.APIVersion, "/"); ok {
					group = "." + g
				}
				want = append(want, strings.ToLower(obj.Kind)+group+"/"+obj.Metadata.Name+" created (server dry run)")
			}
			file := filepath.Join(t.TempDir(), "rendered.yaml")
			if err := os.WriteFile(file, []byte(strings.Join(docs, "\n---\n")), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := controlPlane.Kubectl(ctx, "apply", "--dry-run=server", "--validate=strict", "-f", file)
			if err != nil {
				t.Fatal(err)
			}
			got := strings.Split(strings.TrimSpace(string(out)), "\n")
			slices.Sort(want)
			slices.Sort(got)
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("kubectl apply --dry-run=server of the rendered chart, output lines (-want +got):\n%s", diff)
			}
		})
	}
}

// prometheusOperator is the Prometheus Operator release whose CRDs the chart's ServiceMonitor and
// PrometheusRule are checked against (its Go module carries them, so the Go module proxy serves
// them; v0.80 is the first with the fields the chart uses and is still current in kube-prometheus).
const prometheusOperator = "github.com/prometheus-operator/prometheus-operator@v0.80.1"

// TestChartMonitoringObjectsServerDryRun installs the Prometheus Operator's ServiceMonitor and
// PrometheusRule CRDs (from its Go module) in the real API server, and applies the chart's
// monitoring objects in server-side dry run against their schemas, strictly: a misspelt field
// fails. The CRDs stay for the rest of the run; nothing else uses them.
func TestChartMonitoringObjectsServerDryRun(t *testing.T) {
	t.Parallel()
	requireKubectl(t)
	helm, err := deploy.HelmBinary()
	if err != nil {
		testenv.Unavailable(t, "helm not found (%v): hack/install-deps.sh monitoring, or set %s", err, deploy.EnvHelm)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	// Outside this module, so go.mod and go.sum stay as they are.
	dl := exec.CommandContext(ctx, "go", "mod", "download", "-json", prometheusOperator)
	dl.Dir = t.TempDir()
	dl.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	out, err := dl.Output()
	var mod struct{ Dir, Error string }
	if err == nil {
		err = json.Unmarshal(out, &mod)
	}
	if err != nil || mod.Dir == "" {
		testenv.Unavailable(t, "cannot download %s for its CRDs: %v %s", prometheusOperator, err, mod.Error)
	}
	crds := filepath.Join(mod.Dir, "example", "prometheus-operator-crd")
	if out, err := controlPlane.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(crds, "monitoring.coreos.com_servicemonitors.yaml"),
		"-f", filepath.Join(crds, "monitoring.coreos.com_prometheusrules.yaml")); err != nil {
		t.Fatalf("install the CRDs: %v\n%s", err, out)
	}
	if out, err := controlPlane.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s",
		"crd/servicemonitors.monitoring.coreos.com", "crd/prometheusrules.monitoring.coreos.com"); err != nil {
		t.Fatalf("CRDs not established: %v\n%s", err, out)
	}

	chart := filepath.Join(repoRoot(t), deploy.ChartPath)
	r, err := deploy.Render(ctx, helm, chart, "kube-portal-proxy", "kube-system", "-f", filepath.Join(chart, "ci", "full-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var docs, want []string
	for _, o := range r.Extra {
		if !strings.HasPrefix(o.GetAPIVersion(), "monitoring.coreos.com/") {
			continue
		}
		data, err := yaml.Marshal(o.Object)
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, string(data))
		want = append(want, strings.ToLower(o.GetKind())+".monitoring.coreos.com/"+o.GetName()+" created (server dry run)")
	}
	if len(docs) != 2 {
		t.Fatalf("rendered %d monitoring.coreos.com objects, want a ServiceMonitor and a PrometheusRule", len(docs))
	}
	file := filepath.Join(t.TempDir(), "monitoring.yaml")
	if err := os.WriteFile(file, []byte(strings.Join(docs, "\n---\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = controlPlane.Kubectl(ctx, "apply", "--dry-run=server", "--validate=strict", "-f", file)
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Split(strings.TrimSpace(string(out)), "\n")
	slices.Sort(want)
	slices.Sort(got)
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("kubectl apply --dry-run=server of the chart's monitoring objects, output lines (-want +got):\n%s", diff)
	}
}
