package auth_test

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe/auth"
)

// TestRBACYAMLIsRBAC: the manifests the chart and docs copy grant what RBAC() does.
func TestRBACYAMLIsRBAC(t *testing.T) {
	var got []*rbacv1.ClusterRole
	for _, doc := range strings.Split(auth.RBACYAML, "\n---\n") {
		role := &rbacv1.ClusterRole{}
		if err := yaml.UnmarshalStrict([]byte(doc), role); err != nil {
			t.Fatalf("rbac.yaml: %v", err)
		}
		got = append(got, role)
	}
	if diff := cmp.Diff(auth.RBAC(), got); diff != "" {
		t.Errorf("rbac.yaml (-RBAC() +yaml):\n%s", diff)
	}
}
