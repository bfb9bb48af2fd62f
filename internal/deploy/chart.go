package deploy

// chart.go renders the Helm chart (deploy/helm/kube-portal-proxy) with the real helm binary and
// reads the result like Load reads deploy/: the four objects both install, strictly decoded, and
// the chart's optional objects (the metrics Service, the Prometheus Operator objects, the
// dashboard ConfigMap) beside them.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// ChartPath is the chart's directory, relative to the repository root.
const ChartPath = "deploy/helm/kube-portal-proxy"

// EnvHelm names the helm binary to use; empty: helm on PATH.
const EnvHelm = "KPP_HELM"

// HelmBinary is the helm to run: $KPP_HELM, or helm on PATH.
func HelmBinary() (string, error) {
	if h := os.Getenv(EnvHelm); h != "" {
		return h, nil
	}
	return exec.LookPath("helm")
}

// Rendered is what `helm template` gave.
type Rendered struct {
	// Manifests are the objects deploy/ has too. Resources is empty.
	Manifests
	// Extra are the other objects, in the order rendered, as the API server would read them.
	Extra []*unstructured.Unstructured
	// YAML is helm's output, every document.
	YAML []byte
}

// Find returns the extra object of that kind and name, or nil.
func (r *Rendered) Find(kind, name string) *unstructured.Unstructured {
	for _, o := range r.Extra {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

// Render runs `helm template release chart --namespace namespace args...` and decodes every
// object. A failure carries helm's message (a schema violation names the value).
func Render(ctx context.Context, helm, chart, release, namespace string, args ...string) (*Rendered, error) {
	out, err := RenderYAML(ctx, helm, chart, release, namespace, args...)
	if err != nil {
		return nil, err
	}
	return decodeRendered(out)
}

// RenderYAML is Render's helm run alone: the rendered documents.
func RenderYAML(ctx context.Context, helm, chart, release, namespace string, args ...string) ([]byte, error) {
	argv := append([]string{"template", release, chart, "--namespace", namespace}, args...)
	cmd := exec.CommandContext(ctx, helm, argv...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("helm %s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// decodeRendered splits helm's output into documents and files each under its kind.
func decodeRendered(out []byte) (*Rendered, error) {
	r := &Rendered{YAML: out}
	var configMaps []*unstructured.Unstructured
	for i, doc := range SplitDocuments(out) {
		var obj map[string]any
		if err := yaml.Unmarshal(doc, &obj); err != nil {
			return nil, fmt.Errorf("rendered document %d: %w", i, err)
		}
		if obj == nil {
			continue // comments only
		}
		u := &unstructured.Unstructured{Object: obj}
		name := fmt.Sprintf("rendered %s %s", u.GetKind(), u.GetName())
		switch u.GetKind() {
		case "ClusterRoleBinding":
			// The proxy's own binding is to kube-proxy's role; others (the flow stream's
			// auth-delegator) are extra.
			if role, _, _ := unstructured.NestedString(obj, "roleRef", "name"); role != "system:node-proxier" {
				r.Extra = append(r.Extra, u)
				continue
			}
			if err := r.add(name, doc); err != nil {
				return nil, err
			}
		case "ServiceAccount", "DaemonSet":
			if err := r.add(name, doc); err != nil {
				return nil, err
			}
		case "ConfigMap":
			configMaps = append(configMaps, u)
		default:
			r.Extra = append(r.Extra, u)
		}
	}
	if r.DaemonSet == nil {
		return nil, errors.New("the chart rendered no DaemonSet")
	}
	if err := r.addConfigMaps(configMaps); err != nil {
		return nil, err
	}
	if r.ServiceAccount == nil || r.ClusterRoleBinding == nil || r.ConfigMap == nil {
		return nil, errors.New("the chart rendered no ServiceAccount, ClusterRoleBinding or ConfigMap")
	}
	return r, nil
}

// addConfigMaps files the proxy's ConfigMap, the one its pod mounts, among the rendered
// ConfigMaps; others (the dashboard) are extra.
func (r *Rendered) addConfigMaps(configMaps []*unstructured.Unstructured) error {
	mounted := map[string]bool{}
	for _, v := range r.DaemonSet.Spec.Template.Spec.Volumes {
		if v.ConfigMap != nil {
			mounted[v.ConfigMap.Name] = true
		}
	}
	for _, u := range configMaps {
		if !mounted[u.GetName()] {
			r.Extra = append(r.Extra, u)
			continue
		}
		doc, err := yaml.Marshal(u.Object)
		if err != nil {
			return err
		}
		if err := r.add("rendered ConfigMap "+u.GetName(), doc); err != nil {
			return err
		}
	}
	return nil
}

// add decodes one document strictly into its field, as Load does for a file.
func (r *Rendered) add(name string, doc []byte) error { return r.Manifests.decode(name, doc) }

// SplitDocuments cuts a multi-document YAML stream at its "---" lines.
func SplitDocuments(data []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	for _, line := range bytes.SplitAfter(data, []byte("\n")) {
		if t := bytes.TrimRight(line, " \r\n"); string(t) == "---" {
			docs = append(docs, bytes.Clone(cur.Bytes()))
			cur.Reset()
			continue
		}
		cur.Write(line)
	}
	return append(docs, cur.Bytes())
}

// RepoRoot finds the repository root above dir (the directory with go.mod).
func RepoRoot(dir string) (string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}
