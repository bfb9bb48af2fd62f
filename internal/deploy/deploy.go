// Package deploy reads the manifests in the repository's deploy/ directory into typed Kubernetes
// objects, strictly, and answers what a node would run: the proxy's arguments with the downward
// API expanded, and the config file the ConfigMap mounts. Tests use it to check the manifests and
// to start the binary exactly as the DaemonSet would. It also renders the Helm chart with the
// real helm into the same objects (chart.go), and reads the chart's Prometheus rules and Grafana
// dashboard for the tests that run them (monitoring.go).
package deploy

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"
)

// ContainerName is the name of the proxy's container in the DaemonSet.
const ContainerName = "kube-portal-proxy"

// Manifests are the objects of a deploy directory, one of each kind.
type Manifests struct {
	// Resources are the files kustomization.yaml lists, in its order.
	Resources          []string
	ServiceAccount     *corev1.ServiceAccount
	ClusterRoleBinding *rbacv1.ClusterRoleBinding
	ConfigMap          *corev1.ConfigMap
	DaemonSet          *appsv1.DaemonSet
}

// kustomization is the part of kustomization.yaml that Load reads.
type kustomization struct {
	Resources []string `json:"resources"`
}

// Load reads dir/kustomization.yaml and every resource it lists. Each object is decoded strictly
// (an unknown field is an error naming the file and the field), each kind must appear once, and
// every YAML file in dir must be listed, so `kubectl apply -k` applies what the directory holds.
func Load(dir string) (*Manifests, error) {
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		return nil, err
	}
	var k kustomization
	if err := yaml.Unmarshal(data, &k); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, "kustomization.yaml"), err)
	}
	if err := checkListed(dir, k.Resources); err != nil {
		return nil, err
	}
	m := &Manifests{Resources: k.Resources}
	for _, name := range k.Resources {
		if err := m.add(filepath.Join(dir, name)); err != nil {
			return nil, err
		}
	}
	for _, c := range []struct {
		kind    string
		missing bool
	}{
		{"ServiceAccount", m.ServiceAccount == nil}, {"ClusterRoleBinding", m.ClusterRoleBinding == nil},
		{"ConfigMap", m.ConfigMap == nil}, {"DaemonSet", m.DaemonSet == nil},
	} {
		if c.missing {
			return nil, fmt.Errorf("%s: no %s among the resources", dir, c.kind)
		}
	}
	return m, nil
}

func checkListed(dir string, resources []string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() || n == "kustomization.yaml" || (!strings.HasSuffix(n, ".yaml") && !strings.HasSuffix(n, ".yml")) {
			continue
		}
		if !slices.Contains(resources, n) {
			return fmt.Errorf("%s: not listed in kustomization.yaml resources", filepath.Join(dir, n))
		}
	}
	return nil
}

// codecs decode the objects strictly: unknown and duplicate fields are errors naming the field.
var codecs = serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict)

// add decodes one manifest file into the field of its kind.
func (m *Manifests) add(file string) error {
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	return m.decode(file, data)
}

// decode files one object (named name in errors) under its kind.
func (m *Manifests) decode(file string, data []byte) error {
	obj, gvk, err := codecs.UniversalDeserializer().Decode(data, nil, nil)
	if err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	var taken bool
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		taken, m.ServiceAccount = m.ServiceAccount != nil, o
	case *rbacv1.ClusterRoleBinding:
		taken, m.ClusterRoleBinding = m.ClusterRoleBinding != nil, o
	case *corev1.ConfigMap:
		taken, m.ConfigMap = m.ConfigMap != nil, o
	case *appsv1.DaemonSet:
		taken, m.DaemonSet = m.DaemonSet != nil, o
	default:
		return fmt.Errorf("%s: unexpected object %s (one document per file: ServiceAccount, ClusterRoleBinding, ConfigMap, DaemonSet)", file, gvk)
	}
	if taken {
		return fmt.Errorf("%s: a second %s", file, gvk.Kind)
	}
	return nil
}

// Container is the proxy's container in the DaemonSet.
func (m *Manifests) Container() (*corev1.Container, error) {
	cs := m.DaemonSet.Spec.Template.Spec.Containers
	for i := range cs {
		if cs[i].Name == ContainerName {
			return &cs[i], nil
		}
	}
	return nil, fmt.Errorf("DaemonSet %s has no container %q", m.DaemonSet.Name, ContainerName)
}

// ProxyArgs are the container's arguments as the kubelet passes them: $(VAR) references expanded
// from the container's environment. fields gives the downward API's values by field path, such
// as "spec.nodeName".
func (m *Manifests) ProxyArgs(fields map[string]string) ([]string, error) {
	c, err := m.Container()
	if err != nil {
		return nil, err
	}
	env, err := environment(c, fields)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(c.Args))
	for i, a := range c.Args {
		out[i] = Expand(a, env)
	}
	return out, nil
}

func environment(c *corev1.Container, fields map[string]string) (map[string]string, error) {
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = Expand(e.Value, env)
		case e.ValueFrom.FieldRef != nil:
			v, ok := fields[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				return nil, fmt.Errorf("env %s: no value given for field %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		default:
			return nil, fmt.Errorf("env %s: only literal values and fieldRef are supported", e.Name)
		}
	}
	return env, nil
}

// Expand replaces $(VAR) with env's value as Kubernetes does for args: an undefined reference
// stays as written, and $$ is a literal $.
func Expand(s string, env map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := env[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String()
}

// ConfigPath is the --config argument: where the container reads its configuration.
func (m *Manifests) ConfigPath() (string, error) {
	c, err := m.Container()
	if err != nil {
		return "", err
	}
	for i, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--config="); ok {
			return v, nil
		}
		if a == "--config" && i+1 < len(c.Args) {
			return c.Args[i+1], nil
		}
	}
	return "", errors.New("the proxy container has no --config argument")
}

// ConfigFile is the content the container reads at ConfigPath: the ConfigMap key that the
// volume mounted there holds. It fails when the argument, mount, volume and ConfigMap disagree.
func (m *Manifests) ConfigFile() (string, error) {
	p, err := m.ConfigPath()
	if err != nil {
		return "", err
	}
	c, _ := m.Container()
	for _, vm := range c.VolumeMounts {
		rel, ok := strings.CutPrefix(p, strings.TrimSuffix(vm.MountPath, "/")+"/")
		if !ok {
			continue
		}
		src, err := m.configMapVolume(vm.Name)
		if err != nil {
			return "", err
		}
		key, err := projectedKey(src, path.Clean(rel))
		if err != nil {
			return "", fmt.Errorf("volume %s: %w", vm.Name, err)
		}
		if src.Name != m.ConfigMap.Name {
			return "", fmt.Errorf("volume %s mounts ConfigMap %s, not %s", vm.Name, src.Name, m.ConfigMap.Name)
		}
		data, ok := m.ConfigMap.Data[key]
		if !ok {
			return "", fmt.Errorf("ConfigMap %s has no key %q for --config=%s", m.ConfigMap.Name, key, p)
		}
		return data, nil
	}
	return "", fmt.Errorf("no volume is mounted where --config=%s points", p)
}

// projectedKey is the ConfigMap key a volume shows at file, which is the key itself unless the
// volume lists items.
func projectedKey(src *corev1.ConfigMapVolumeSource, file string) (string, error) {
	if len(src.Items) == 0 {
		return file, nil
	}
	for _, it := range src.Items {
		if path.Clean(it.Path) == file {
			return it.Key, nil
		}
	}
	return "", fmt.Errorf("no item projects %s", file)
}

func (m *Manifests) configMapVolume(name string) (*corev1.ConfigMapVolumeSource, error) {
	for _, v := range m.DaemonSet.Spec.Template.Spec.Volumes {
		if v.Name == name {
			if v.ConfigMap == nil {
				return nil, fmt.Errorf("volume %s is not a ConfigMap", name)
			}
			return v.ConfigMap, nil
		}
	}
	return nil, fmt.Errorf("no volume %s in the pod", name)
}

// LocalArgs are the arguments for running the binary outside a pod as the DaemonSet runs it on
// node nodeName, with --config pointing at configFile (a copy of ConfigFile) and the hand-over
// socket, a host path in the pod, beside it: two local runs must not meet on the host's socket.
// The bind state file and the restart snapshot (host paths too) and the ready file (in the container's own filesystem in
// the pod) go beside it too.
func (m *Manifests) LocalArgs(nodeName, configFile string) ([]string, error) {
	args, err := m.ProxyArgs(map[string]string{"spec.nodeName": nodeName})
	if err != nil {
		return nil, err
	}
	for i, a := range args {
		if strings.HasPrefix(a, "--handover-socket=") {
			args[i] = "--handover-socket=" + filepath.Join(filepath.Dir(configFile), "handover.sock")
		}
		if strings.HasPrefix(a, "--bind-state-file=") {
			args[i] = "--bind-state-file=" + filepath.Join(filepath.Dir(configFile), "bind-state.json")
		}
		if strings.HasPrefix(a, "--restart-snapshot-file=") {
			args[i] = "--restart-snapshot-file=" + filepath.Join(filepath.Dir(configFile), "restart-snapshot")
		}
		if strings.HasPrefix(a, "--ready-file=") {
			args[i] = "--ready-file=" + filepath.Join(filepath.Dir(configFile), "ready")
		}
	}
	for i, a := range args {
		if strings.HasPrefix(a, "--config=") {
			args[i] = "--config=" + configFile
			return args, nil
		}
		if a == "--config" && i+1 < len(args) {
			args[i+1] = configFile
			return args, nil
		}
	}
	return nil, errors.New("the proxy container has no --config argument")
}
