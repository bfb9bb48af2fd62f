package auth

import (
	_ "embed"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The ClusterRoles that grant the stream: flows alone, or flows and capture. Capture is a role of
// its own because payload is more sensitive than the flows' addresses and timings.
const (
	ObserverRole = "kube-portal-proxy-observer"
	CaptureRole  = "kube-portal-proxy-capture"
)

// RBACYAML is RBAC() as the YAML manifests the Helm chart and the docs carry, with comments; a
// test keeps the two equal.
//
//go:embed rbac.yaml
var RBACYAML string

// RBAC returns the ClusterRoles an operator binds to the users of the stream. The proxy's own
// identity needs system:auth-delegator besides (create tokenreviews and subjectaccessreviews).
func RBAC() []*rbacv1.ClusterRole {
	role := func(name string, subresources ...string) *rbacv1.ClusterRole {
		var resources []string
		for _, s := range subresources {
			resources = append(resources, Resource+"/"+s)
		}
		return &rbacv1.ClusterRole{
			TypeMeta: metav1.TypeMeta{APIVersion: rbacv1.SchemeGroupVersion.String(), Kind: "ClusterRole"},
			ObjectMeta: metav1.ObjectMeta{
				Name:   name,
				Labels: map[string]string{"app.kubernetes.io/name": "kube-portal-proxy"},
			},
			Rules: []rbacv1.PolicyRule{
				{APIGroups: []string{""}, Resources: resources, Verbs: []string{Verb}},
				// observe --node reads the Node, --all-nodes lists them, for their addresses.
				{APIGroups: []string{""}, Resources: []string{Resource}, Verbs: []string{"get", "list"}},
			},
		}
	}
	return []*rbacv1.ClusterRole{
		role(ObserverRole, SubresourceFlows),
		role(CaptureRole, SubresourceFlows, SubresourceCapture),
	}
}
