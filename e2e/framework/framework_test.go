package framework

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
)

// Address plan: Services get ClusterIPs from 10.96.0.0/16 and endpoints use 10.244.1.0/24. Both are
// API data only; these tests send no traffic anywhere but the API server on 127.0.0.1.

func TestFindBinaries(t *testing.T) {
	executable := func(t *testing.T, path string) string {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		return path
	}
	tests := []struct {
		name string
		// setup creates files under dir and returns the environment to set.
		setup   func(t *testing.T, dir string) map[string]string
		want    func(dir string) Binaries
		wantErr error
	}{
		{
			name: "cache_convention",
			setup: func(t *testing.T, dir string) map[string]string {
				executable(t, filepath.Join(dir, "bin", "kube-apiserver-"+KubeVersion))
				executable(t, filepath.Join(dir, "bin", "etcd-"+EtcdVersion))
				executable(t, filepath.Join(dir, "bin", "kubectl-"+KubeVersion))
				return map[string]string{EnvCache: dir}
			},
			want: func(dir string) Binaries {
				return Binaries{
					APIServer: filepath.Join(dir, "bin", "kube-apiserver-"+KubeVersion),
					Etcd:      filepath.Join(dir, "bin", "etcd-"+EtcdVersion),
					Kubectl:   filepath.Join(dir, "bin", "kubectl-"+KubeVersion),
				}
			},
		},
		{
			name: "environment_overrides_cache",
			setup: func(t *testing.T, dir string) map[string]string {
				executable(t, filepath.Join(dir, "bin", "kube-apiserver-"+KubeVersion))
				executable(t, filepath.Join(dir, "bin", "etcd-"+EtcdVersion))
				return map[string]string{
					EnvCache:     dir,
					EnvAPIServer: executable(t, filepath.Join(dir, "x", "apiserver")),
					EnvEtcd:      executable(t, filepath.Join(dir, "x", "etcd")),
					EnvKubectl:   executable(t, filepath.Join(dir, "x", "kubectl")),
				}
			},
			want: func(dir string) Binaries {
				return Binaries{
					APIServer: filepath.Join(dir, "x", "apiserver"),
					Etcd:      filepath.Join(dir, "x", "etcd"),
					Kubectl:   filepath.Join(dir, "x", "kubectl"),
				}
			},
		},
		{
			name: "kubectl_is_optional",
			setup: func(t *testing.T, dir string) map[string]string {
				executable(t, filepath.Join(dir, "bin", "kube-apiserver-"+KubeVersion))
				executable(t, filepath.Join(dir, "bin", "etcd-"+EtcdVersion))
				return map[string]string{EnvCache: dir}
			},
			want: func(dir string) Binaries {
				return Binaries{
					APIServer: filepath.Join(dir, "bin", "kube-apiserver-"+KubeVersion),
					Etcd:      filepath.Join(dir, "bin", "etcd-"+EtcdVersion),
				}
			},
		},
		{
			name: "missing_apiserver",
			setup: func(t *testing.T, dir string) map[string]string {
				executable(t, filepath.Join(dir, "bin", "etcd-"+EtcdVersion))
				return map[string]string{EnvCache: dir}
			},
			wantErr: ErrBinariesMissing,
		},
		{
			name: "etcd_not_executable",
			setup: func(t *testing.T, dir string) map[string]string {
				executable(t, filepath.Join(dir, "bin", "kube-apiserver-"+KubeVersion))
				if err := os.WriteFile(filepath.Join(dir, "bin", "etcd-"+EtcdVersion), nil, 0o644); err != nil {
					t.Fatal(err)
				}
				return map[string]string{EnvCache: dir}
			},
			wantErr: ErrBinariesMissing,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, name := range []string{EnvCache, EnvAPIServer, EnvEtcd, EnvKubectl} {
				t.Setenv(name, "")
			}
			dir := t.TempDir()
			for k, v := range tt.setup(t, dir) {
				t.Setenv(k, v)
			}
			got, err := FindBinaries()
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("FindBinaries() error = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("FindBinaries(): %v", err)
			}
			if diff := cmp.Diff(tt.want(dir), got); diff != "" {
				t.Errorf("FindBinaries() (-want +got):\n%s", diff)
			}
		})
	}
}

func TestEtcdEnvDropsEtcdVariables(t *testing.T) {
	t.Setenv("ETCD_DATA_DIR", "/should/not/be/used")
	t.Setenv("KPP_KEEP", "1")
	var kept bool
	for _, kv := range etcdEnv() {
		if len(kv) >= 5 && kv[:5] == "ETCD_" {
			t.Errorf("etcdEnv() passes %q to etcd", kv)
		}
		kept = kept || kv == "KPP_KEEP=1"
	}
	if !kept {
		t.Errorf("etcdEnv() dropped KPP_KEEP=1, want other variables kept")
	}
}

// TestProxyIdentity checks what the proxy under test will rely on: its kubeconfig authenticates as
// system:kube-proxy, which may read and watch services, endpointslices and nodes, and write none.
func TestProxyIdentity(t *testing.T) {
	cp := StartControlPlane(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	svc, slice, node := createObjects(ctx, t, cp.AdminClient(), "web")
	clusterRange := netip.MustParsePrefix(ServiceClusterIPRange)
	if ip, err := netip.ParseAddr(svc.Spec.ClusterIP); err != nil || !clusterRange.Contains(ip) {
		t.Errorf("service ClusterIP = %q, want an address in %s", svc.Spec.ClusterIP, clusterRange)
	}
	proxy := cp.ProxyClient()

	t.Run("authenticates_as_system:kube-proxy", func(t *testing.T) {
		review, err := proxy.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("SelfSubjectReview: %v", err)
		}
		if got := review.Status.UserInfo.Username; got != ProxyUser {
			t.Errorf("username = %q, want %q", got, ProxyUser)
		}
	})

	t.Run("lists", func(t *testing.T) {
		tests := []struct {
			resource string
			list     func() ([]string, error)
			want     []string
		}{
			{"services", func() ([]string, error) {
				l, err := proxy.CoreV1().Services(svc.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + svc.Name})
				if err != nil {
					return nil, err
				}
				var got []string
				for _, s := range l.Items {
					got = append(got, s.Name+" "+s.Spec.ClusterIP)
				}
				return got, nil
			}, []string{svc.Name + " " + svc.Spec.ClusterIP}},
			{"endpointslices", func() ([]string, error) {
				l, err := proxy.DiscoveryV1().EndpointSlices(slice.Namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svc.Name})
				if err != nil {
					return nil, err
				}
				var got []string
				for _, s := range l.Items {
					for _, e := range s.Endpoints {
						got = append(got, s.Name+" "+e.Addresses[0])
					}
				}
				return got, nil
			}, []string{slice.Name + " 10.244.1.10"}},
			{"nodes", func() ([]string, error) {
				l, err := proxy.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
				if err != nil {
					return nil, err
				}
				var got []string
				for _, n := range l.Items {
					got = append(got, n.Name)
				}
				return got, nil
			}, []string{node.Name}},
		}
		for _, tt := range tests {
			t.Run(tt.resource, func(t *testing.T) {
				got, err := tt.list()
				if err != nil {
					t.Fatalf("list %s: %v", tt.resource, err)
				}
				if diff := cmp.Diff(tt.want, got); diff != "" {
					t.Errorf("list %s (-want +got):\n%s", tt.resource, diff)
				}
			})
		}
	})

	t.Run("watches", func(t *testing.T) {
		admin := cp.AdminClient()
		tests := []struct {
			resource string
			watch    func() (watch.Interface, error)
			create   func() (string, error) // returns the new object's name
		}{
			{"services", func() (watch.Interface, error) {
				return proxy.CoreV1().Services(svc.Namespace).Watch(ctx, metav1.ListOptions{ResourceVersion: svc.ResourceVersion})
			}, func() (string, error) {
				s, err := admin.CoreV1().Services(svc.Namespace).Create(ctx, newService("watched"), metav1.CreateOptions{})
				return objectName(s, err)
			}},
			{"endpointslices", func() (watch.Interface, error) {
				return proxy.DiscoveryV1().EndpointSlices(slice.Namespace).Watch(ctx, metav1.ListOptions{ResourceVersion: slice.ResourceVersion})
			}, func() (string, error) {
				s, err := admin.DiscoveryV1().EndpointSlices(slice.Namespace).Create(ctx, newEndpointSlice("watched", "10.244.1.11"), metav1.CreateOptions{})
				return objectName(s, err)
			}},
			{"nodes", func() (watch.Interface, error) {
				return proxy.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{ResourceVersion: node.ResourceVersion})
			}, func() (string, error) {
				n, err := admin.CoreV1().Nodes().Create(ctx, newNode("watched"), metav1.CreateOptions{})
				return objectName(n, err)
			}},
		}
		for _, tt := range tests {
			t.Run(tt.resource, func(t *testing.T) {
				w, err := tt.watch()
				if err != nil {
					t.Fatalf("watch %s: %v", tt.resource, err)
				}
				defer w.Stop()
				name, err := tt.create()
				if err != nil {
					t.Fatalf("create %s as admin: %v", tt.resource, err)
				}
				waitForAdded(ctx, t, w, name)
			})
		}
	})

	t.Run("cannot_write", func(t *testing.T) {
		tests := []struct {
			name  string
			write func() error
		}{
			{"create_service", func() error {
				_, err := proxy.CoreV1().Services(svc.Namespace).Create(ctx, newService("forbidden"), metav1.CreateOptions{})
				return err
			}},
			{"delete_service", func() error {
				return proxy.CoreV1().Services(svc.Namespace).Delete(ctx, svc.Name, metav1.DeleteOptions{})
			}},
			{"create_endpointslice", func() error {
				_, err := proxy.DiscoveryV1().EndpointSlices(slice.Namespace).Create(ctx, newEndpointSlice("forbidden", "10.244.1.12"), metav1.CreateOptions{})
				return err
			}},
			{"delete_node", func() error {
				return proxy.CoreV1().Nodes().Delete(ctx, node.Name, metav1.DeleteOptions{})
			}},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				if err := tt.write(); !apierrors.IsForbidden(err) {
					t.Errorf("%s as %s: error = %v, want Forbidden", tt.name, ProxyUser, err)
				}
			})
		}
	})
}

// TestStopLeavesNothingRunning checks that Stop ends both daemons, frees the API server's port and
// removes the directory Start created.
func TestStopLeavesNothingRunning(t *testing.T) {
	bins, err := FindBinaries()
	if err != nil {
		skipOrFail(t, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), DefaultStartTimeout)
	defer cancel()
	cp, err := Start(ctx, Options{Binaries: bins})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { cp.Stop() }) // in case an assertion below stops the test early
	pids := map[string]int{"kube-apiserver": cp.apiserver.pid(), "etcd": cp.etcd.pid()}
	addr := cp.Server[len("https://"):]

	if err := cp.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	for name, pid := range pids {
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("%s (pid %d) after Stop: kill(0) = %v, want ESRCH", name, pid, err)
		}
	}
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Errorf("API server address %s still accepts connections after Stop", addr)
	}
	if _, err := os.Stat(cp.Dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("control plane dir %s after Stop: stat error = %v, want not exist", cp.Dir, err)
	}
	if err := cp.Stop(); err != nil {
		t.Errorf("second Stop: %v, want nil", err)
	}
}

// TestStartFailureLeavesNothingRunning checks the failure path: when kube-apiserver dies during
// startup, Start reports its log, stops the etcd it already started and removes its directory.
func TestStartFailureLeavesNothingRunning(t *testing.T) {
	bins, err := FindBinaries()
	if err != nil {
		skipOrFail(t, err)
	}
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // where Start makes its directory
	bins.APIServer = filepath.Join(tmp, "broken-apiserver")
	script := "#!/bin/sh\necho 'broken-apiserver: cannot start' >&2\nexit 3\n"
	if err := os.WriteFile(bins.APIServer, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), DefaultStartTimeout)
	defer cancel()

	cp, err := Start(ctx, Options{Binaries: bins})
	if err == nil {
		cp.Stop()
		t.Fatal("Start with a failing kube-apiserver succeeded, want an error")
	}
	if !strings.Contains(err.Error(), "broken-apiserver: cannot start") {
		t.Errorf("Start error does not quote the kube-apiserver log:\n%v", err)
	}
	if kids := childProcesses(t); len(kids) > 0 {
		t.Errorf("child processes left after a failed Start: %v", kids)
	}
	if entries, err := os.ReadDir(tmp); err != nil || len(entries) != 1 {
		t.Errorf("TMPDIR after a failed Start holds %v (err %v), want only the fake binary", entries, err)
	}
}

// childProcesses lists the PIDs of this test process's children.
func childProcesses(t *testing.T) []string {
	t.Helper()
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	var kids []string
	for _, f := range tasks {
		data, err := os.ReadFile(f)
		if err != nil {
			continue // the thread ended
		}
		kids = append(kids, strings.Fields(string(data))...)
	}
	return kids
}

func createObjects(ctx context.Context, t *testing.T, admin kubernetes.Interface, name string) (*corev1.Service, *discoveryv1.EndpointSlice, *corev1.Node) {
	t.Helper()
	svc, err := admin.CoreV1().Services(metav1.NamespaceDefault).Create(ctx, newService(name), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create service: %v", err)
	}
	slice, err := admin.DiscoveryV1().EndpointSlices(metav1.NamespaceDefault).Create(ctx, newEndpointSlice(name, "10.244.1.10"), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create endpointslice: %v", err)
	}
	node, err := admin.CoreV1().Nodes().Create(ctx, newNode("node-1"), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create node: %v", err)
	}
	return svc, slice, node
}

func newService(name string) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.ServiceSpec{
			Ports: []corev1.ServicePort{{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}
}

// newEndpointSlice makes the slice a controller-manager would make for service name; none runs here.
func newEndpointSlice(service, addr string) *discoveryv1.EndpointSlice {
	ready := true
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:   service + "-abc12",
			Labels: map[string]string{discoveryv1.LabelServiceName: service},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{{
			Addresses:  []string{addr},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready},
		}},
		Ports: []discoveryv1.EndpointPort{{Name: ptr("http"), Protocol: ptr(corev1.ProtocolTCP), Port: ptr(int32(8080))}},
	}
}

func newNode(name string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
}

func ptr[T any](v T) *T { return &v }

func objectName(obj metav1.Object, err error) (string, error) {
	if err != nil {
		return "", err
	}
	return obj.GetName(), nil
}

// waitForAdded waits for w to report an ADDED event for an object called name.
func waitForAdded(ctx context.Context, t *testing.T, w watch.Interface, name string) {
	t.Helper()
	for {
		select {
		case <-ctx.Done():
			t.Fatalf("no ADDED event for %q: %v", name, ctx.Err())
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatalf("watch closed before an ADDED event for %q", name)
			}
			if ev.Type == watch.Error {
				t.Fatalf("watch error: %v", apierrors.FromObject(ev.Object))
			}
			if obj, isObj := ev.Object.(metav1.Object); isObj && ev.Type == watch.Added && obj.GetName() == name {
				return
			}
		}
	}
}
