// Package framework gives end-to-end tests a real Kubernetes control plane: etcd and kube-apiserver,
// built once by hack/controlplane-build.sh, started on loopback with free ports, with kubeconfigs for
// an admin and for the system:kube-proxy identity the proxy runs as, and stopped by PID afterwards.
//
// A test calls StartControlPlane(t). A package whose tests share one control plane (a start costs a
// few seconds) starts it from TestMain instead:
//
//	func TestMain(m *testing.M) { os.Exit(runTests(m)) }
//
//	func runTests(m *testing.M) int {
//		ctx, cancel := context.WithTimeout(context.Background(), framework.DefaultStartTimeout)
//		defer cancel()
//		cp, err := framework.Start(ctx, framework.Options{})
//		if errors.Is(err, framework.ErrBinariesMissing) && !testenv.Required() {
//			fmt.Println("e2e skipped:", err)
//			return 0
//		}
//		if err != nil {
//			fmt.Println(err)
//			return 1
//		}
//		defer cp.Stop()
//		controlPlane = cp
//		return m.Run()
//	}
//
// The control plane has no controller-manager and no kubelet: tests create EndpointSlices and
// Nodes themselves, and ClusterIPs are only data (no traffic to them outside test namespaces).
package framework
