package config

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// countingHandler counts the objects delivered and what the counts were when each initial list
// was reported synced. Each add does a little work, so delivery lags the informers' stores.
type countingHandler struct {
	mu                           sync.Mutex
	services, slices             int
	servicesAtSync, slicesAtSync int
	servicesSynced, slicesSynced bool
}

func (h *countingHandler) OnServiceAdd(*v1.Service) {
	busy()
	h.mu.Lock()
	h.services++
	h.mu.Unlock()
}
func (h *countingHandler) OnServiceUpdate(_, _ *v1.Service) {}
func (h *countingHandler) OnServiceDelete(*v1.Service)      {}
func (h *countingHandler) OnServicesSynced() {
	h.mu.Lock()
	h.servicesAtSync, h.servicesSynced = h.services, true
	h.mu.Unlock()
}
func (h *countingHandler) OnEndpointSliceAdd(*discovery.EndpointSlice) {
	busy()
	h.mu.Lock()
	h.slices++
	h.mu.Unlock()
}
func (h *countingHandler) OnEndpointSliceUpdate(_, _ *discovery.EndpointSlice) {}
func (h *countingHandler) OnEndpointSliceDelete(*discovery.EndpointSlice)      {}
func (h *countingHandler) OnEndpointSlicesSynced() {
	h.mu.Lock()
	h.slicesAtSync, h.slicesSynced = h.slices, true
	h.mu.Unlock()
}

// busy spends 300 µs of CPU per object (converting a large object takes about as long), so
// delivering the initial list takes longer than the 100 ms poll of cache.WaitForCacheSync.
func busy() {
	for t0 := time.Now(); time.Since(t0) < 300*time.Microsecond; {
	}
}

func TestInformerSourceReportsSyncedOnlyAfterEveryObjectOfTheInitialListIsDelivered(t *testing.T) {
	const n = 1000
	var objs []runtime.Object
	for i := range n {
		name := fmt.Sprintf("s%d", i)
		objs = append(objs,
			&v1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"},
				Spec: v1.ServiceSpec{ClusterIP: "10.96.0.10", Ports: []v1.ServicePort{{Name: "http", Port: 80}}}},
			&discovery.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: name + "-1", Namespace: "ns",
				Labels: map[string]string{discovery.LabelServiceName: name}}, AddressType: discovery.AddressTypeIPv4})
	}
	h := &countingHandler{}
	log := logrus.New()
	log.SetLevel(logrus.WarnLevel)
	src := NewInformerSource(fake.NewSimpleClientset(objs...), 0, h, log)
	runSource(t, src)

	testenv.WaitFor(t, "both initial lists reported synced", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.servicesSynced && h.slicesSynced
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.servicesAtSync != n || h.slicesAtSync != n {
		t.Errorf("synced reported with %d of %d services and %d of %d slices delivered, want all", h.servicesAtSync, n, h.slicesAtSync, n)
	}
}

// managedHandler records whether any delivered object still had managedFields.
type managedHandler struct {
	countingHandler
	withManaged int
}

func (h *managedHandler) OnServiceAdd(s *v1.Service) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.services++
	if len(s.ManagedFields) > 0 {
		h.withManaged++
	}
}

func (h *managedHandler) OnEndpointSliceAdd(s *discovery.EndpointSlice) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.slices++
	if len(s.ManagedFields) > 0 {
		h.withManaged++
	}
}

func TestInformerSourceCachesObjectsWithoutManagedFields(t *testing.T) {
	managed := []metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationApply}}
	h := &managedHandler{}
	src := NewInformerSource(fake.NewSimpleClientset(
		&v1.Service{ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "ns", ManagedFields: managed},
			Spec: v1.ServiceSpec{ClusterIP: "10.96.0.10", Ports: []v1.ServicePort{{Name: "http", Port: 80}}}},
		&discovery.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: "a-1", Namespace: "ns", ManagedFields: managed,
			Labels: map[string]string{discovery.LabelServiceName: "a"}}, AddressType: discovery.AddressTypeIPv4},
	), 0, h, logrus.New())
	runSource(t, src)
	testenv.WaitFor(t, "both objects delivered and the lists synced", func() bool {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.services == 1 && h.slices == 1 && h.servicesSynced && h.slicesSynced
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.withManaged != 0 {
		t.Errorf("%d objects delivered with managedFields, want none", h.withManaged)
	}
}

// runSource runs src until the test ends, then checks Run returned cleanly.
func runSource(t *testing.T, src *InformerSource) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}
