package daemon

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/deploy"
)

// TestDeployManifests checks what the DaemonSet must get right on a real cluster (that it runs
// the image's binary is checked next to the Dockerfile, in the root package). The manifests
// are decoded strictly into the API types (internal/deploy); the end-to-end suite also applies
// them to a kube-apiserver with --dry-run=server.
func TestDeployManifests(t *testing.T) {
	m, err := deploy.Load("../deploy")
	if err != nil {
		t.Fatalf("deploy.Load: %v", err)
	}
	ds := m.DaemonSet
	pod := ds.Spec.Template.Spec
	c, err := m.Container()
	if err != nil {
		t.Fatal(err)
	}

	// The effective options of a node, started as the DaemonSet starts the proxy.
	cfg := filepath.Join(t.TempDir(), "config.conf")
	data, err := m.ConfigFile()
	if err != nil {
		t.Fatalf("ConfigFile: %v", err)
	}
	if err := os.WriteFile(cfg, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	args, err := m.LocalArgs("node-1", cfg)
	if err != nil {
		t.Fatalf("LocalArgs: %v", err)
	}
	o, _, err := parseOptions(args)
	if err != nil {
		t.Fatalf("the DaemonSet's command line %q with its ConfigMap does not start: %v", args, err)
	}
	healthz, err := netip.ParseAddrPort(o.healthzBindAddress)
	if err != nil {
		t.Fatalf("healthz address %q: %v", o.healthzBindAddress, err)
	}

	t.Run("config_file_is_clean", func(t *testing.T) {
		if len(o.configIgnored) > 0 || len(o.configWarnings) > 0 {
			t.Errorf("ConfigMap sets ignored fields %q / warns %q", o.configIgnored, o.configWarnings)
		}
		if o.hostnameOverride != "node-1" || o.configFields["hostname-override"] != "" {
			t.Errorf("hostname = %q (from the file: %v), want node-1 from --hostname-override=$(NODE_NAME)",
				o.hostnameOverride, o.configFields["hostname-override"] != "")
		}
		if !healthz.Addr().IsUnspecified() {
			t.Errorf("healthz listens on %v; the kubelet probes the node IP, want all addresses", healthz)
		}
	})

	t.Run("node_name_from_the_downward_API", func(t *testing.T) {
		i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "NODE_NAME" })
		if i < 0 || c.Env[i].ValueFrom == nil || c.Env[i].ValueFrom.FieldRef == nil || c.Env[i].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
			t.Errorf("NODE_NAME is not the downward API's spec.nodeName: %+v", c.Env)
		}
		if !slices.Contains(c.Args, "--hostname-override=$(NODE_NAME)") {
			t.Errorf("args %q lack --hostname-override=$(NODE_NAME)", c.Args)
		}
	})

	t.Run("node_level_pod", func(t *testing.T) {
		if !pod.HostNetwork {
			t.Error("hostNetwork is false: portal rules and proxy sockets must be in the node's namespace")
		}
		if pod.PriorityClassName != "system-node-critical" {
			t.Errorf("priorityClassName = %q", pod.PriorityClassName)
		}
		if !slices.ContainsFunc(pod.Tolerations, func(tol corev1.Toleration) bool {
			return tol.Operator == corev1.TolerationOpExists && tol.Key == "" && tol.Effect == ""
		}) {
			t.Errorf("tolerations %+v do not tolerate every taint", pod.Tolerations)
		}
		u := ds.Spec.UpdateStrategy
		if u.Type != "RollingUpdate" || u.RollingUpdate == nil || u.RollingUpdate.MaxUnavailable == nil || u.RollingUpdate.MaxUnavailable.String() != "0" ||
			u.RollingUpdate.MaxSurge == nil || u.RollingUpdate.MaxSurge.String() != "1" {
			t.Errorf("update strategy %+v, want RollingUpdate with maxSurge 1, maxUnavailable 0 (the new pod takes over from the old one)", u)
		}
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			if q, ok := c.Resources.Requests[r]; !ok || q.IsZero() {
				t.Errorf("no %s request", r)
			}
		}
	})

	t.Run("surge_pod_schedulable_next_to_the_old_one", func(t *testing.T) {
		// With hostNetwork a containerPort is a hostPort; the scheduler's NodePorts filter would
		// keep the surge pod off the node its predecessor runs on.
		for _, ctr := range append(slices.Clone(pod.InitContainers), pod.Containers...) {
			if len(ctr.Ports) > 0 {
				t.Errorf("container %s declares ports %+v: the surge pod of an update could not be scheduled", ctr.Name, ctr.Ports)
			}
		}
	})

	// Files kept on a mounted host path, so they outlive the container: the mount itself
	// (hostPath, DirectoryOrCreate) is checked in host_mounts. Run locally, each goes beside the
	// local config, so two local runs never meet on the host's files.
	for _, hf := range []struct {
		name, flag, what, whyNeeded, local string
		got                                string
	}{
		{"handover_socket_on_a_host_path", "--handover-socket", "the hand-over socket",
			"an update would refuse connections", "handover.sock", o.handoverSocket},
		{"bind_state_file_on_a_host_path", "--bind-state-file", "the bind state file",
			"bind mode would refuse every port for a whole cold start after a crash", "bind-state.json", o.bindStateFile},
		{"restart_snapshot_on_a_host_path", "--restart-snapshot-file", "the restart snapshot",
			"a restart after a crash would hold every connection for a whole cold start", "restart-snapshot", o.restartSnapshot},
	} {
		t.Run(hf.name, func(t *testing.T) {
			path := argValue(c.Args, hf.flag)
			if path == "" {
				t.Fatalf("args %q lack %s: %s", c.Args, hf.flag, hf.whyNeeded)
			}
			if !slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool { return vm.MountPath == filepath.Dir(path) }) {
				t.Errorf("%s %s is not in a mounted host directory (mounts %+v)", hf.what, path, c.VolumeMounts)
			}
			if hf.got != filepath.Join(filepath.Dir(cfg), hf.local) {
				t.Errorf("run locally, %s is %s, want it beside the local config", hf.what, hf.got)
			}
		})
	}

	t.Run("new_pod_ready_only_once_its_own_process_serves", func(t *testing.T) {
		// The HTTP probes of the new pod of an update reach the old process too (shared health
		// port); only a file in the new container's own filesystem speaks for the new process.
		path := argValue(c.Args, "--ready-file")
		if path == "" {
			t.Fatalf("args %q lack --ready-file: the new pod of an update could turn Ready on the old process's answer", c.Args)
		}
		p := c.StartupProbe
		if p == nil || p.Exec == nil || !slices.Equal(p.Exec.Command, []string{"test", "-e", path}) {
			t.Errorf("startupProbe %+v, want exec test -e %s", p, path)
		}
		for _, vm := range c.VolumeMounts {
			if strings.HasPrefix(path, strings.TrimSuffix(vm.MountPath, "/")+"/") {
				t.Errorf("the ready file %s is under the mount %s; it must be the container's own", path, vm.MountPath)
			}
		}
		if o.readyFile != filepath.Join(filepath.Dir(cfg), "ready") {
			t.Errorf("run locally, the ready file is %s, want it beside the local config", o.readyFile)
		}
	})

	t.Run("capabilities_not_privileged", func(t *testing.T) {
		sc := c.SecurityContext
		if sc == nil || sc.Capabilities == nil {
			t.Fatal("no securityContext.capabilities")
		}
		if sc.Privileged != nil && *sc.Privileged {
			t.Error("privileged: the proxy needs capabilities only")
		}
		for _, want := range []corev1.Capability{"NET_ADMIN", "NET_BIND_SERVICE", "NET_RAW", "SYS_RESOURCE"} {
			if !slices.Contains(sc.Capabilities.Add, want) {
				t.Errorf("capabilities %v lack %s", sc.Capabilities.Add, want)
			}
		}
	})

	t.Run("probes_on_the_healthz_port", func(t *testing.T) {
		for _, p := range []struct {
			name  string
			probe *corev1.Probe
			path  string
		}{{"liveness", c.LivenessProbe, "/livez"}, {"readiness", c.ReadinessProbe, "/healthz"}} {
			if p.probe == nil || p.probe.HTTPGet == nil {
				t.Errorf("%s probe is not an HTTP GET", p.name)
				continue
			}
			g := p.probe.HTTPGet
			if g.Path != p.path || g.Port.IntValue() != int(healthz.Port()) {
				t.Errorf("%s probe GET %s on port %s, want %s on %d", p.name, g.Path, g.Port.String(), p.path, healthz.Port())
			}
		}
	})

	t.Run("host_mounts", func(t *testing.T) {
		want := map[string]struct {
			hostPath string
			readOnly bool
			typ      corev1.HostPathType
		}{
			"/run/xtables.lock":          {"/run/xtables.lock", false, corev1.HostPathFileOrCreate},
			"/lib/modules":               {"/lib/modules", true, ""},
			"/var/run/kube-portal-proxy": {"/var/run/kube-portal-proxy", false, corev1.HostPathDirectoryOrCreate},
		}
		for _, vm := range c.VolumeMounts {
			w, ok := want[vm.MountPath]
			if !ok {
				continue
			}
			delete(want, vm.MountPath)
			i := slices.IndexFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == vm.Name })
			if i < 0 || pod.Volumes[i].HostPath == nil {
				t.Errorf("%s is not a hostPath volume", vm.MountPath)
				continue
			}
			hp := pod.Volumes[i].HostPath
			typ := corev1.HostPathType("")
			if hp.Type != nil {
				typ = *hp.Type
			}
			if hp.Path != w.hostPath || vm.ReadOnly != w.readOnly || typ != w.typ {
				t.Errorf("%s: hostPath %s type %q readOnly %v, want %s %q %v", vm.MountPath, hp.Path, typ, vm.ReadOnly, w.hostPath, w.typ, w.readOnly)
			}
		}
		for p := range want {
			t.Errorf("%s is not mounted", p)
		}
	})

	t.Run("service_account_bound_to_node_proxier", func(t *testing.T) {
		sa, crb := m.ServiceAccount, m.ClusterRoleBinding
		if pod.ServiceAccountName != sa.Name || sa.Namespace != ds.Namespace {
			t.Errorf("pod runs as %s in %s; ServiceAccount is %s/%s", pod.ServiceAccountName, ds.Namespace, sa.Namespace, sa.Name)
		}
		if got := crb.RoleRef.Kind + "/" + crb.RoleRef.Name; got != "ClusterRole/system:node-proxier" {
			t.Errorf("roleRef = %s", got)
		}
		var subjects []string
		for _, s := range crb.Subjects {
			subjects = append(subjects, s.Kind+" "+s.Namespace+"/"+s.Name)
		}
		if diff := cmp.Diff([]string{"ServiceAccount " + sa.Namespace + "/" + sa.Name}, subjects); diff != "" {
			t.Errorf("binding subjects (-want +got):\n%s", diff)
		}
	})

}

// argValue returns the value of the last --flag=value in args, or "".
func argValue(args []string, flag string) string {
	var v string
	for _, a := range args {
		if after, ok := strings.CutPrefix(a, flag+"="); ok {
			v = after
		}
	}
	return v
}
