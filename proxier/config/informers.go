package config

import (
	"context"
	"fmt"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// InformerSource feeds a Handler from the API server with shared informers, using kube-proxy's
// label selector (no service-proxy-name, no headless).
type InformerSource struct {
	client kubernetes.Interface
	resync time.Duration
	h      Handler
	log    logrus.FieldLogger
}

// NewInformerSource builds the source; Run starts the watches.
func NewInformerSource(client kubernetes.Interface, resync time.Duration, h Handler, log logrus.FieldLogger) *InformerSource {
	return &InformerSource{client: client, resync: resync, h: h, log: log}
}

func proxySelector() string {
	noProxyName, _ := labels.NewRequirement(LabelServiceProxyName, selection.DoesNotExist, nil)
	noHeadless, _ := labels.NewRequirement(v1.IsHeadlessService, selection.DoesNotExist, nil)
	return labels.NewSelector().Add(*noProxyName, *noHeadless).String()
}

// Run watches until ctx is done. It reports the initial lists as synced once both caches filled.
func (s *InformerSource) Run(ctx context.Context) error {
	factory := informers.NewSharedInformerFactoryWithOptions(s.client, s.resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = proxySelector() }),
		informers.WithTransform(stripManagedFields))
	svcInformer := factory.Core().V1().Services().Informer()
	sliceInformer := factory.Discovery().V1().EndpointSlices().Informer()
	// The registrations' HasSynced, not the informers': an informer has synced once its store
	// holds the initial list, a registration once its handler has been given every object of it
	// (as kube-proxy's config does). With the informer's, the first sync could run on part of
	// the list.
	svcReg, err := svcInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { typed(o, s.h.OnServiceAdd) },
		UpdateFunc: func(old, cur any) { typed2(old, cur, s.h.OnServiceUpdate) },
		DeleteFunc: func(o any) { typed(o, s.h.OnServiceDelete) },
	})
	if err != nil {
		return fmt.Errorf("service informer: %w", err)
	}
	sliceReg, err := sliceInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { typed(o, s.h.OnEndpointSliceAdd) },
		UpdateFunc: func(old, cur any) { typed2(old, cur, s.h.OnEndpointSliceUpdate) },
		DeleteFunc: func(o any) { typed(o, s.h.OnEndpointSliceDelete) },
	})
	if err != nil {
		return fmt.Errorf("endpointslice informer: %w", err)
	}
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForNamedCacheSync("services", ctx.Done(), svcReg.HasSynced) {
		return ctx.Err()
	}
	s.h.OnServicesSynced()
	if !cache.WaitForNamedCacheSync("endpointslices", ctx.Done(), sliceReg.HasSynced) {
		return ctx.Err()
	}
	s.h.OnEndpointSlicesSynced()
	// Marks the end of the initial lists (bench/scale -cluster times the cold start from here).
	s.log.Info("Informers' initial lists done")
	<-ctx.Done()
	return nil
}

// stripManagedFields drops an object's managedFields before the informer caches it: the proxy
// never reads them, and at 10,000 Services and EndpointSlices they were a good part of the
// caches' memory.
func stripManagedFields(o any) (any, error) {
	if m, err := meta.Accessor(o); err == nil {
		m.SetManagedFields(nil)
	}
	return o, nil
}

// untombstone unwraps the final state of an object deleted while the watch was down.
func untombstone(o any) any {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		return t.Obj
	}
	return o
}

// typed calls f with o when it is a T (after unwrapping a tombstone).
func typed[T any](o any, f func(T)) {
	if v, ok := untombstone(o).(T); ok {
		f(v)
	}
}

// typed2 calls f with an update's old (possibly zero) and current object.
func typed2[T any](old, cur any, f func(old, cur T)) {
	o, _ := old.(T)
	if c, ok := cur.(T); ok {
		f(o, c)
	}
}
