package daemon

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/deploy"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// forwardFlags are flags the chart passes only when set, for builds that have them. A build
// without one is still tested with everything else.
var forwardFlags = []string{"--default-data-path", "--io-engine"}

// TestChartValuesReachTheProxy renders the chart with every value set (ci/full-values.yaml) and
// parses the DaemonSet's command line with its ConfigMap as the proxy does at start: every value
// arrives as the option it is meant to set, and the config file has nothing the proxy ignores.
func TestChartValuesReachTheProxy(t *testing.T) {
	helm, err := deploy.HelmBinary()
	if err != nil {
		testenv.Unavailable(t, "helm not found (%v): hack/install-deps.sh monitoring, or set %s", err, deploy.EnvHelm)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	chart := filepath.Join("..", deploy.ChartPath)
	m, err := deploy.Render(ctx, helm, chart, "kpp", "kube-system", "-f", filepath.Join(chart, "ci", "full-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(t.TempDir(), "config.conf")
	data, err := m.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	args, err := m.LocalArgs("node-1", cfg)
	if err != nil {
		t.Fatal(err)
	}
	known := newFlagSet(&Options{})
	var kept []string
	for _, a := range args {
		name, _, _ := strings.Cut(a, "=")
		if known.Lookup(strings.TrimPrefix(name, "--")) == nil {
			if !slices.Contains(forwardFlags, name) {
				t.Errorf("the chart passes %s, which this build does not know", a)
			}
			t.Logf("this build has no %s yet: left out", name)
			continue
		}
		kept = append(kept, a)
	}
	o, _, err := parseOptions(kept)
	if err != nil {
		t.Fatalf("the rendered command line %q with its ConfigMap does not start: %v", kept, err)
	}
	if len(o.configIgnored) > 0 || len(o.configWarnings) > 0 {
		t.Errorf("the rendered ConfigMap sets ignored fields %q / warns %q", o.configIgnored, o.configWarnings)
	}
	type view struct {
		PortalMode, PortalInterface, ProxyPortRange, ClusterCIDR, Healthz, Metrics, MetricsOnly, LogLevel, LogFormat, IptablesVariant, SourceMode, NodePodCIDR string
		NodePorts                                                                                                                                              []string
		Sync, MinSync, ConfigSync, UDP, TCPIdle, Shutdown, Established, CloseWait                                                                              time.Duration
		UDPMax, Burst                                                                                                                                          int
		QPS                                                                                                                                                    float32
		OOM, MaxPerCore, ConntrackMin                                                                                                                          int32
		AccessLog, Protect, Drain, Profiling                                                                                                                   bool
		Flows                                                                                                                                                  flowOptions
	}
	got := view{o.portalMode, o.portalInterface, o.proxyPortRange, o.clusterCIDR, o.healthzBindAddress, o.metricsBindAddress, o.metricsOnlyBindAddress, o.logLevel, o.logFormat, o.iptablesVariant, o.sourceMode, o.nodePodCIDR,
		o.nodePortAddresses, o.syncPeriod, o.minSyncPeriod, o.configSyncPeriod, o.udpTimeout, o.tcpIdleTimeout, o.shutdownTimeout, o.conntrackTCPEstablished, o.conntrackTCPCloseWait,
		o.udpMaxSessions, o.apiBurst, o.apiQPS, o.oomScoreAdj, o.conntrackMaxPerCore, o.conntrackMin, o.accessLog, o.protectProxyPorts, o.drainEndpoints, o.profiling, o.flows}
	want := view{"bind", "kpp0", "40000-40999", "10.244.0.0/16,fd00:10:244::/56", "0.0.0.0:10266", "127.0.0.1:10259", "0.0.0.0:10251", "debug", "json", "nft", "transparent", "10.244.0.0/24",
		[]string{"192.0.2.0/24", "2001:db8::/64"}, time.Minute, 2 * time.Second, 30 * time.Minute, 30 * time.Second, time.Hour, 20 * time.Second, 12 * time.Hour, 30 * time.Minute,
		2048, 40, 25 /* extraArgs override the file's 20 */, -500, 65536, 262144, true, false, true, true,
		flowOptions{ringSize: 1024, maxObservers: 4, maxRate: 500, captureBytes: 4096, capture: true, bindAddress: "0.0.0.0:10262"}}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(flowOptions{})); diff != "" {
		t.Errorf("options from the chart's full values (-want +got):\n%s", diff)
	}

	// Prometheus scrapes the address that serves /metrics alone, never the metrics address
	// with the debug pages: the ServiceMonitor's port is the metrics Service's, whose target is
	// the port of the proxy's --metrics-only-bind-address.
	metricsOnly, err := netip.ParseAddrPort(o.metricsOnlyBindAddress)
	if err != nil {
		t.Fatalf("metrics-only address %q: %v", o.metricsOnlyBindAddress, err)
	}
	svc, sm := m.Find("Service", "kpp-kube-portal-proxy-metrics"), m.Find("ServiceMonitor", "kpp-kube-portal-proxy")
	if svc == nil || sm == nil {
		t.Fatalf("the full values render no metrics Service (%v) or ServiceMonitor (%v)", svc != nil, sm != nil)
	}
	ports, _, _ := unstructured.NestedSlice(svc.Object, "spec", "ports")
	endpoints, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
	if len(ports) != 1 || len(endpoints) != 1 {
		t.Fatalf("metrics Service ports %v, ServiceMonitor endpoints %v: want one each", ports, endpoints)
	}
	port, endpoint := ports[0].(map[string]any), endpoints[0].(map[string]any)
	if port["targetPort"] != float64(metricsOnly.Port()) || endpoint["port"] != port["name"] || endpoint["path"] != "/metrics" {
		t.Errorf("the ServiceMonitor scrapes %v %v of Service port %v; want /metrics at the metrics-only port %d",
			endpoint["port"], endpoint["path"], port, metricsOnly.Port())
	}
}
