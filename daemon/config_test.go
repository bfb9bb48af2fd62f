package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	logtest "github.com/sirupsen/logrus/hooks/test"
)

// effective is what a --config file can change, for comparing options.
type effective struct {
	Kubeconfig, Hostname, Bind, Healthz, Metrics, PortRange, LogFormat string
	QPS                                                                float32
	Burst                                                              int
	Sync, MinSync, ConfigSync, UDPTimeout                              time.Duration
	NodePorts                                                          []string
	OOMScoreAdj                                                        int32
	CTMaxPerCore, CTMin                                                int32
	CTEstablished, CTCloseWait, CTUDP, CTUDPStream                     time.Duration
	CTBeLiberal                                                        bool
	Flows                                                              string // flowOptions, %+v
	Ignored, Warnings                                                  []string
}

func effectiveOf(o *Options) effective {
	return effective{
		Kubeconfig: o.kubeconfig, Hostname: o.hostnameOverride, Bind: o.bindAddress,
		Healthz: o.healthzBindAddress, Metrics: o.metricsBindAddress, PortRange: o.proxyPortRange, LogFormat: o.logFormat,
		QPS: o.apiQPS, Burst: o.apiBurst,
		Sync: o.syncPeriod, MinSync: o.minSyncPeriod, ConfigSync: o.configSyncPeriod, UDPTimeout: o.udpTimeout,
		NodePorts: o.nodePortAddresses, OOMScoreAdj: o.oomScoreAdj,
		CTMaxPerCore: o.conntrackMaxPerCore, CTMin: o.conntrackMin,
		CTEstablished: o.conntrackTCPEstablished, CTCloseWait: o.conntrackTCPCloseWait,
		CTUDP: o.conntrackUDPTimeout, CTUDPStream: o.conntrackUDPStreamTimeout, CTBeLiberal: o.conntrackTCPBeLiberal,
		Flows:   fmt.Sprintf("%+v", o.flows),
		Ignored: o.configIgnored, Warnings: o.configWarnings,
	}
}

// defaults is the effective configuration without --config or flags (kube-proxy's defaults).
func defaults(t *testing.T) effective {
	t.Helper()
	o, _, err := parseOptions(nil)
	if err != nil {
		t.Fatalf("parseOptions(nil): %v", err)
	}
	return effectiveOf(o)
}

func writeTemp(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDefaultsAreKubeProxys(t *testing.T) {
	got := defaults(t)
	want := effective{
		Bind: "0.0.0.0", Healthz: "0.0.0.0:10256", Metrics: "127.0.0.1:10249", LogFormat: "text",
		QPS: 5, Burst: 10, Sync: 30 * time.Second, MinSync: time.Second, ConfigSync: 15 * time.Minute,
		UDPTimeout: 10 * time.Second, OOMScoreAdj: -999, CTMaxPerCore: 32768, CTMin: 131072,
		CTEstablished: 24 * time.Hour, CTCloseWait: time.Hour,
		Flows: fmt.Sprintf("%+v", flowOptions{ringSize: 8192, maxObservers: 16, maxRate: 10000, captureBytes: 65536}),
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("defaults (-want +got):\n%s", diff)
	}
}

// TestConfigFile decodes real KubeProxyConfiguration files and checks the effective settings.
func TestConfigFile(t *testing.T) {
	tests := []struct {
		name string
		file string
		args []string
		want func(e *effective)
	}{{
		name: "kubeadm_defaults_change_only_the_kubeconfig",
		file: "testdata/config/kubeadm-defaults.yaml",
		want: func(e *effective) { e.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf" },
	}, {
		name: "tuned_kubeadm_cluster_maps_every_field_and_lists_the_rest",
		file: "testdata/config/kubeadm-cluster.yaml",
		want: func(e *effective) {
			e.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf"
			e.QPS, e.Burst = 10, 20
			e.Healthz = "0.0.0.0:10256" // a bare IP gets kube-proxy's port
			e.Metrics = "0.0.0.0:10249"
			e.LogFormat = "json"
			e.Sync, e.MinSync, e.ConfigSync = time.Minute, 2*time.Second, 10*time.Minute
			e.NodePorts = []string{"10.0.0.0/24", "fd00::/64"}
			e.OOMScoreAdj = -998
			e.CTMaxPerCore, e.CTMin = 65536, 262144
			e.CTEstablished, e.CTCloseWait = 12*time.Hour, 30*time.Minute
			e.CTUDP, e.CTUDPStream, e.CTBeLiberal = 30*time.Second, 2*time.Minute, true
			e.Ignored = []string{"clientConnection.contentType", "detectLocalMode",
				"iptables.masqueradeAll", "iptables.masqueradeBit", "logging.verbosity"}
		},
	}, {
		name: "legacy_userspace_file_with_udpIdleTimeout",
		file: "testdata/config/legacy-userspace.yaml",
		want: func(e *effective) {
			e.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf"
			e.Bind, e.PortRange, e.Hostname = "192.0.2.10", "30000-30999", "node-a"
			e.UDPTimeout = 250 * time.Millisecond
			e.Warnings = []string{"udpIdleTimeout 250ms (the legacy default was 250ms) ends UDP sessions before a resolver retries: consider 10s or more"}
		},
	}, {
		name: "explicit_flags_override_the_file",
		file: "testdata/config/kubeadm-cluster.yaml",
		args: []string{"--kube-api-qps=50", "--hostname-override=node-b", "--conntrack-max-per-core=0",
			"--nodeport-addresses=192.168.0.0/16", "--iptables-sync-period=30s", "--log-format=text"},
		want: func(e *effective) {
			e.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf"
			e.QPS, e.Burst = 50, 20
			e.Hostname = "node-b"
			e.Healthz, e.Metrics = "0.0.0.0:10256", "0.0.0.0:10249"
			// Given explicitly with its default value, a flag still wins over the file.
			e.Sync, e.MinSync, e.ConfigSync = 30*time.Second, 2*time.Second, 10*time.Minute
			e.NodePorts = []string{"192.168.0.0/16"}
			e.OOMScoreAdj = -998
			e.CTMaxPerCore, e.CTMin = 0, 262144
			e.CTEstablished, e.CTCloseWait = 12*time.Hour, 30*time.Minute
			e.CTUDP, e.CTUDPStream, e.CTBeLiberal = 30*time.Second, 2*time.Minute, true
			e.Ignored = []string{"clientConnection.contentType", "detectLocalMode",
				"iptables.masqueradeAll", "iptables.masqueradeBit", "logging.verbosity"}
		},
	}, {
		name: "explicit_zero_pointers_are_values_not_defaults",
		file: writeTemp(t, "zeros.yaml", `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: userspace
oomScoreAdj: 0
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`),
		want: func(e *effective) {
			e.OOMScoreAdj = 0
			e.CTMaxPerCore, e.CTMin, e.CTEstablished, e.CTCloseWait = 0, 0, 0, 0
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := defaults(t)
			tt.want(&want)
			o, _, err := parseOptions(append([]string{"--config=" + tt.file}, tt.args...))
			if err != nil {
				t.Fatalf("parseOptions: %v", err)
			}
			if diff := cmp.Diff(want, effectiveOf(o)); diff != "" {
				t.Errorf("effective configuration (-want +got):\n%s", diff)
			}
		})
	}
}

// TestConfigFileErrors checks that a bad file is refused with an error naming the field.
func TestConfigFileErrors(t *testing.T) {
	const head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	tests := []struct {
		name string
		file string
		want []string // substrings of the error
	}{
		{"unknown_field", head + "bindAdress: 0.0.0.0\n", []string{`unknown field "bindAdress"`}},
		{"unknown_nested_field", head + "conntrack:\n  maxPercore: 1\n", []string{`unknown field "conntrack.maxPercore"`}},
		{"wrong_type", head + "clientConnection:\n  qps: fast\n", []string{"clientConnection.qps"}},
		{"malformed_duration", head + "iptables:\n  syncPeriod: 5 minutes\n", []string{"iptables.syncPeriod", `"5 minutes"`}},
		{"duration_as_number", head + "configSyncPeriod: 60\n", []string{"configSyncPeriod", "want a duration"}},
		{"malformed_legacy_udpIdleTimeout", head + "udpIdleTimeout: soon\n", []string{"udpIdleTimeout"}},
		{"ioEngine_not_a_string", head + "ioEngine: 1\n", []string{"ioEngine", "want a string"}},
		{"duplicate_field", head + "bindAddress: 0.0.0.0\nbindAddress: 10.0.0.1\n", []string{`"bindAddress"`}},
		{"iptables_mode", head + "mode: iptables\n", []string{`mode "iptables"`, "userspace (portal) mode", "keep kube-proxy"}},
		{"ipvs_mode", head + "mode: ipvs\n", []string{`mode "ipvs"`, "mode: userspace"}},
		{"nodePortAddresses_primary", head + "nodePortAddresses: [primary]\n", []string{"nodePortAddresses", `"primary"`, "not supported"}},
		{"newer_apiVersion", "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n", []string{`apiVersion "kubeproxy.config.k8s.io/v1alpha2"`, "want kubeproxy.config.k8s.io/v1alpha1"}},
		{"missing_kind", "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n", []string{"kind missing: want KubeProxyConfiguration"}},
		{"not_a_mapping", "- a\n- b\n", []string{"want a YAML mapping"}},
		{"not_yaml", head + "bindAddress: [\n", []string{"not valid YAML"}},
		{"loopback_bind_address", head + "bindAddress: 127.0.0.1\n", []string{"--bind-address (field bindAddress of --config", "localhost"}},
		{"min_sync_above_sync", head + "iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 5s\n", []string{"field iptables.minSyncPeriod", "must not exceed"}},
		{"oomScoreAdj_out_of_range", head + "oomScoreAdj: 2000\n", []string{"field oomScoreAdj", "[-1000, 1000]"}},
		{"bad_port_range", head + "portRange: 10-x\n", []string{"field portRange"}},
		{"bad_cidr", head + "nodePortAddresses: [10.0.0.0/33]\n", []string{"field nodePortAddresses", "10.0.0.0/33"}},
		{"flows_unknown_field", head + "flows:\n  ringsize: 10\n", []string{"flows:", `unknown field "ringsize"`}},
		{"flows_wrong_type", head + "flows:\n  capture: yes please\n", []string{"flows:", "capture"}},
		{"flows_not_an_object", head + "flows: 100\n", []string{"flows:", "want an object"}},
		{"flows_ring_too_big", head + "flows:\n  ringSize: 100000000\n", []string{"--flow-ring-size (field flows.ringSize of --config", "must be 0-"}},
		{"flows_bind_address", head + "flows:\n  bindAddress: nowhere\n", []string{"--flows-bind-address (field flows.bindAddress", "want ip:port"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := writeTemp(t, "config.yaml", tt.file)
			_, _, err := parseOptions([]string{"--config", path})
			if err == nil {
				t.Fatalf("parseOptions accepted:\n%s", tt.file)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
	t.Run("missing_file", func(t *testing.T) {
		_, _, err := parseOptions([]string{"--config", filepath.Join(t.TempDir(), "absent.yaml")})
		if err == nil || !strings.HasPrefix(err.Error(), "--config: ") {
			t.Errorf("error = %v, want one starting with --config", err)
		}
	})
	t.Run("primary_flag", func(t *testing.T) {
		_, _, err := parseOptions([]string{"--nodeport-addresses=primary"})
		if err == nil || !strings.Contains(err.Error(), "not supported") {
			t.Errorf("error = %v, want primary refused as not supported", err)
		}
	})
}

// TestIgnoredFieldsLoggedOnce checks the startup log: one line listing every ignored field.
func TestIgnoredFieldsLoggedOnce(t *testing.T) {
	o, _, err := parseOptions([]string{"--config=testdata/config/kubeadm-cluster.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	log, hook := logtest.NewNullLogger()
	logConfigNotes(log, o)
	var got []string
	for _, e := range hook.AllEntries() {
		got = append(got, e.Level.String()+": "+e.Message+" fields="+fmtField(e.Data["fields"]))
	}
	want := []string{"info: Ignoring configuration fields that mean nothing to the userspace proxy " +
		"fields=clientConnection.contentType,detectLocalMode,iptables.masqueradeAll,iptables.masqueradeBit,logging.verbosity"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("log (-want +got):\n%s", diff)
	}

	hook.Reset()
	o, _, err = parseOptions([]string{"--config=testdata/config/kubeadm-defaults.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	logConfigNotes(log, o)
	if n := len(hook.AllEntries()); n != 0 {
		t.Errorf("kubeadm defaults logged %d lines, want none (nothing set is ignored)", n)
	}
}

func fmtField(v any) string {
	if v == nil {
		return ""
	}
	return v.(string)
}

// TestWriteConfigReadsBack writes the effective configuration and starts from it again: the
// file plus the flags its header lists give the same options.
func TestWriteConfigReadsBack(t *testing.T) {
	tests := []struct {
		name      string
		args      []string
		wantFlags []string // in the header
	}{
		{"defaults", nil, nil},
		{"tuned_kubeadm_file_and_flags", []string{"--config=testdata/config/kubeadm-cluster.yaml", "--hostname-override=node-c", "--udp-timeout=30s"}, nil},
		{"legacy_file", []string{"--config=testdata/config/legacy-userspace.yaml"}, nil},
		{
			name: "settings_without_a_field_or_with_a_zero_value",
			args: []string{"--udp-max-sessions=500", "--protect-proxy-ports=false", "--healthz-bind-address=",
				"--iptables-min-sync-period=0", "--access-log"},
			wantFlags: []string{"--udp-max-sessions=500", "--iptables-min-sync-period=0s", "--healthz-bind-address=",
				"--protect-proxy-ports=false", "--access-log=true"},
		},
		{"flow_stream", []string{"--flow-ring-size=100", "--flow-max-observers=2", "--flow-max-rate=0", "--flow-capture",
			"--flow-capture-bytes=1024", "--flows-bind-address=0.0.0.0:10259"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "effective.yaml")
			o, _, err := parseOptions(append(tt.args, "--write-config-to="+out))
			if err != nil {
				t.Fatal(err)
			}
			if err := o.WriteConfig("test"); err != nil {
				t.Fatalf("WriteConfig: %v", err)
			}
			data, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			flags := headerFlags(t, string(data))
			if diff := cmp.Diff(tt.wantFlags, flags); diff != "" {
				t.Errorf("flags in the header (-want +got):\n%s\nfile:\n%s", diff, data)
			}
			back, _, err := parseOptions(append([]string{"--config=" + out}, flags...))
			if err != nil {
				t.Fatalf("reading back:\n%s\nerror: %v", data, err)
			}
			want, got := effectiveOf(o), effectiveOf(back)
			want.Ignored, got.Ignored, want.Warnings, got.Warnings = nil, nil, nil, nil
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("read back (-want +got):\n%s\nfile:\n%s", diff, data)
			}
			for _, f := range tt.wantFlags {
				if strings.HasSuffix(f, "=") && !strings.Contains(string(data), "#   "+f+`""`) {
					t.Errorf("header does not quote the empty value of %s:\n%s", f, data)
				}
			}
			if !strings.Contains(string(data), "\nmode: userspace\n") {
				t.Errorf("written file does not say mode: userspace:\n%s", data)
			}
		})
	}
}

// headerFlags returns the flags listed in a written file's header comment, unquoted.
func headerFlags(t *testing.T, data string) []string {
	t.Helper()
	var out []string
	for _, l := range strings.Split(data, "\n") {
		f, ok := strings.CutPrefix(l, "#   --")
		if !ok {
			continue
		}
		name, value, _ := strings.Cut(f, "=")
		if strings.HasPrefix(value, `"`) {
			v, err := strconv.Unquote(value)
			if err != nil {
				t.Fatalf("header line %q: %v", l, err)
			}
			value = v
		}
		out = append(out, "--"+name+"="+value)
	}
	return out
}

func TestWriteConfigFileErrorNamesTheFlag(t *testing.T) {
	o, _, err := parseOptions([]string{"--write-config-to=" + filepath.Join(t.TempDir(), "missing-dir", "x.yaml")})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.WriteConfig("test"); err == nil || !strings.HasPrefix(err.Error(), "--write-config-to: ") {
		t.Errorf("error = %v, want one starting with --write-config-to", err)
	}
}
