package deploy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const repoDeploy = "../../deploy"

func TestLoadRepositoryManifests(t *testing.T) {
	m, err := Load(repoDeploy)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	got := []string{m.ServiceAccount.Name, m.ClusterRoleBinding.Name, m.ConfigMap.Name, m.DaemonSet.Name}
	want := []string{"kube-portal-proxy", "kube-portal-proxy", "kube-portal-proxy", "kube-portal-proxy"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("object names (-want +got):\n%s", diff)
	}

	args, err := m.LocalArgs("node-1", "/tmp/kpp/config.conf")
	if err != nil {
		t.Fatalf("LocalArgs: %v", err)
	}
	// The hand-over socket, a host path in the pod, and the ready file move beside the local config.
	if diff := cmp.Diff([]string{"--config=/tmp/kpp/config.conf", "--hostname-override=node-1", "--handover-socket=/tmp/kpp/handover.sock", "--bind-state-file=/tmp/kpp/bind-state.json", "--restart-snapshot-file=/tmp/kpp/restart-snapshot", "--ready-file=/tmp/kpp/ready"}, args); diff != "" {
		t.Errorf("LocalArgs (-want +got):\n%s", diff)
	}
	p, err := m.ConfigPath()
	if err != nil || p != "/var/lib/kube-portal-proxy/config.conf" {
		t.Errorf("ConfigPath = %q, %v", p, err)
	}
	cfg, err := m.ConfigFile()
	if err != nil {
		t.Fatalf("ConfigFile: %v", err)
	}
	if !strings.Contains(cfg, "kind: KubeProxyConfiguration\n") {
		t.Errorf("ConfigFile is not a KubeProxyConfiguration:\n%s", cfg)
	}
}

func TestExpand(t *testing.T) {
	env := map[string]string{"NODE_NAME": "node-1", "EMPTY": ""}
	tests := []struct{ in, want string }{
		{"--hostname-override=$(NODE_NAME)", "--hostname-override=node-1"},
		{"$(NODE_NAME)-$(NODE_NAME)", "node-1-node-1"},
		{"x$(EMPTY)y", "xy"},
		{"$(UNDEFINED) stays", "$(UNDEFINED) stays"},
		{"$$(NODE_NAME) is escaped", "$(NODE_NAME) is escaped"},
		{"cost $5 and $$", "cost $5 and $"},
		{"unterminated $(NODE_NAME", "unterminated $(NODE_NAME"},
		{"trailing $", "trailing $"},
	}
	for _, tt := range tests {
		if got := Expand(tt.in, env); got != tt.want {
			t.Errorf("Expand(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// copyDeploy copies the repository's manifests to a temporary directory, applying edit to the
// named file's content.
func copyDeploy(t *testing.T, file string, edit func(string) string) string {
	t.Helper()
	dir := t.TempDir()
	entries, err := os.ReadDir(repoDeploy)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(repoDeploy, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		if e.Name() == file {
			if s2 := edit(s); s2 != s {
				s = s2
			} else {
				t.Fatalf("edit of %s changed nothing", file)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, e.Name()), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// replace is an edit of a manifest: the first old becomes new.
func replace(old, new string) func(string) string {
	return func(s string) string { return strings.Replace(s, old, new, 1) }
}

func TestLoadRejects(t *testing.T) {
	tests := []struct {
		name string
		file string
		edit func(string) string
		want []string
	}{
		{"unknown_field", "daemonset.yaml", replace("hostNetwork: true", "hostNetwork: true\n      hostNetwrk: true"), []string{"daemonset.yaml", `unknown field "spec.template.spec.hostNetwrk"`}},
		{"duplicate_field", "serviceaccount.yaml", replace("  name: kube-portal-proxy\n", "  name: kube-portal-proxy\n  name: other\n"), []string{"serviceaccount.yaml", `"name"`}},
		{"wrong_type", "daemonset.yaml", replace("maxUnavailable: 0", "maxUnavailable: [0]"), []string{"daemonset.yaml", "maxUnavailable"}},
		{"unexpected_kind", "serviceaccount.yaml", replace("kind: ServiceAccount", "kind: Secret"), []string{"serviceaccount.yaml", "unexpected object /v1, Kind=Secret"}},
		{"unlisted_file", "kustomization.yaml", replace("- configmap.yaml\n", ""), []string{"configmap.yaml", "not listed"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Load(copyDeploy(t, tt.file, tt.edit))
			if err == nil {
				t.Fatal("Load accepted the broken manifests")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestConfigFileFollowsTheMount(t *testing.T) {
	tests := []struct {
		name string
		file string
		edit func(string) string
		want string // error substring
	}{
		{"arg_points_elsewhere", "daemonset.yaml", replace("--config=/var/lib/kube-portal-proxy/config.conf", "--config=/etc/kpp/config.conf"), "no volume is mounted"},
		{"key_renamed", "configmap.yaml", replace("config.conf: |", "proxy.conf: |"), `no key "config.conf"`},
		{"other_configmap", "daemonset.yaml", replace("configMap:\n          name: kube-portal-proxy", "configMap:\n          name: kube-proxy"), "mounts ConfigMap kube-proxy"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := Load(copyDeploy(t, tt.file, tt.edit))
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			if _, err := m.ConfigFile(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("ConfigFile error = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestProxyArgsNeedsTheDownwardAPIValue(t *testing.T) {
	m, err := Load(repoDeploy)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.ProxyArgs(nil); err == nil || !strings.Contains(err.Error(), "spec.nodeName") {
		t.Errorf("ProxyArgs(nil) error = %v, want one naming spec.nodeName", err)
	}
}
