// Package e2e runs the real kube-portal-proxy binary the way a node runs it: as system:kube-proxy
// against a real kube-apiserver and etcd (package framework), inside a throwaway node network
// namespace with pod, client and external-host namespaces around it (internal/testbed), and checks
// real traffic through its portals: ClusterIP from a pod and from the node, UDP, NodePort, external
// IPs, round robin, ClientIP affinity, endpoints changing under load, service deletion, a SIGKILLed
// proxy restarting, --cleanup, and the standalone --services-file mode.
//
// TestTwoNodes runs two nodes (zone-a and zone-b), each with its own proxy and pods, linked so pods
// reach pods across nodes (internal/testbed.NewCluster), and ports the two-node Service scenarios
// of kubernetes test/e2e/network/service.go under their upstream names (traffic policies, fallback
// to terminating endpoints, the health check node port, rejection without endpoints,
// publishNotReadyAddresses) plus topology hints, on EndpointSlices written as the EndpointSlice
// controller would. Each scenario runs alone with -run 'TestTwoNodes/<name, spaces as _>'.
//
// The tests need root (network namespaces, iptables) and the control plane binaries that
// hack/controlplane-build.sh builds; without them they skip, unless KPP_E2E_REQUIRE=1 makes them
// fail. KPP_BINARY names a prebuilt proxy binary; otherwise TestMain builds one.
package e2e
