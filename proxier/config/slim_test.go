package config

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// richMeta has every metadata field a real object may carry.
func richMeta(name string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name), ResourceVersion: "42",
		Generation: 3, CreationTimestamp: metav1.Unix(1_700_000_000, 0),
		Labels:          map[string]string{discovery.LabelServiceName: "web", "app": "web"},
		Annotations:     map[string]string{lastApplied: `{"big":"copy"}`, "kube-portal-proxy.io/hold-timeout": "5s"},
		OwnerReferences: []metav1.OwnerReference{{Kind: "Service", Name: "web", UID: "uid-web"}},
		Finalizers:      []string{"example.com/f"},
		ManagedFields:   []metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationApply}},
	}
}

// keptMeta is what slim keeps of richMeta.
func keptMeta(name string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name), ResourceVersion: "42",
		Labels:      map[string]string{discovery.LabelServiceName: "web", "app": "web"},
		Annotations: map[string]string{"kube-portal-proxy.io/hold-timeout": "5s"}}
}

// TestSlimKeepsWhatTheProxyReads checks the informers' transform: every field the proxier reads
// (convert.go, annotations, access log) survives, the rest is dropped.
func TestSlimKeepsWhatTheProxyReads(t *testing.T) {
	local := v1.ServiceInternalTrafficPolicyLocal
	spec := v1.ServiceSpec{
		Type: v1.ServiceTypeLoadBalancer, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10", "fd00::10"},
		Ports:                    []v1.ServicePort{{Name: "http", Protocol: v1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080), NodePort: 30080, AppProtocol: ptr.To("http")}},
		ExternalIPs:              []string{"203.0.113.1"},
		SessionAffinity:          v1.ServiceAffinityClientIP,
		SessionAffinityConfig:    &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](30)}},
		LoadBalancerSourceRanges: []string{"192.0.2.0/24"},
		ExternalTrafficPolicy:    v1.ServiceExternalTrafficPolicyLocal, HealthCheckNodePort: 31000,
		InternalTrafficPolicy: &local, TrafficDistribution: ptr.To(v1.ServiceTrafficDistributionPreferClose),
	}
	lb := v1.LoadBalancerStatus{Ingress: []v1.LoadBalancerIngress{{IP: "198.51.100.1"}}}
	rich := spec
	rich.Selector = map[string]string{"app": "web"}
	rich.IPFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
	rich.IPFamilyPolicy = ptr.To(v1.IPFamilyPolicyPreferDualStack)
	rich.LoadBalancerClass = ptr.To("example.com/lb")
	rich.AllocateLoadBalancerNodePorts = ptr.To(true)
	svc := &v1.Service{ObjectMeta: richMeta("web"), Spec: rich,
		Status: v1.ServiceStatus{LoadBalancer: lb, Conditions: []metav1.Condition{{Type: "Ready"}}}}
	wantSvc := &v1.Service{ObjectMeta: keptMeta("web"), Spec: spec, Status: v1.ServiceStatus{LoadBalancer: lb}}

	ports := []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}}
	cond := discovery.EndpointConditions{Ready: ptr.To(true), Serving: ptr.To(true), Terminating: ptr.To(false)}
	hints := &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "a"}}, ForNodes: []discovery.ForNode{{Name: "n1"}}}
	slice := &discovery.EndpointSlice{ObjectMeta: richMeta("web-1"), AddressType: discovery.AddressTypeIPv4, Ports: ports,
		Endpoints: []discovery.Endpoint{
			{Addresses: []string{"10.244.1.1"}, Conditions: cond, Hostname: ptr.To("web-0"), NodeName: ptr.To("n1"), Zone: ptr.To("a"),
				Hints: hints, DeprecatedTopology: map[string]string{"k": "v"},
				TargetRef: &v1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "web-0", UID: "uid-pod", ResourceVersion: "7", APIVersion: "v1"}},
			{Addresses: []string{"10.244.1.2"}, Conditions: cond},
		}}
	wantSlice := &discovery.EndpointSlice{ObjectMeta: keptMeta("web-1"), AddressType: discovery.AddressTypeIPv4, Ports: ports,
		Endpoints: []discovery.Endpoint{
			{Addresses: []string{"10.244.1.1"}, Conditions: cond, NodeName: ptr.To("n1"), Zone: ptr.To("a"), Hints: hints,
				TargetRef: &v1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "web-0"}},
			{Addresses: []string{"10.244.1.2"}, Conditions: cond},
		}}
	plain := &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: "ns", Annotations: map[string]string{"a": "b"}}}

	tests := []struct {
		name string
		in   any
		want any
	}{
		{"service: read fields kept, the rest dropped", svc, wantSvc},
		{"endpointslice: read fields kept, the rest dropped", slice, wantSlice},
		{"a service with only kept fields comes out equal", plain, &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: "ns", Annotations: map[string]string{"a": "b"}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := slim(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Fatalf("slim (-want +got):\n%s", d)
			}
		})
	}
}
