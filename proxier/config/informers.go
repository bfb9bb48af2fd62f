package config

import (
	"context"
	"fmt"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
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
		informers.WithTransform(slim))
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

// slim is the informers' transform: the caches keep a copy of every Service and EndpointSlice
// beside the proxier's own model, so they keep only what the proxier reads (convert.go, the
// annotations, the access log's pod and node) and drop the rest before it is stored: managed
// fields, owner references, finalizers, kubectl's last-applied-configuration annotation (often
// the largest part of a real object), a Service's selector, IP family fields and conditions, an
// endpoint's hostname, deprecated topology and the UID and version of its target. The decoded
// object is trimmed in place (it is the informer's own, freshly decoded, as client-go allows):
// building a slim copy instead cost an allocation per object in the initial lists.
func slim(o any) (any, error) {
	switch v := o.(type) {
	case *v1.Service:
		slimMeta(&v.ObjectMeta)
		v.Spec.Selector, v.Spec.IPFamilies, v.Spec.IPFamilyPolicy = nil, nil, nil
		v.Spec.LoadBalancerClass, v.Spec.AllocateLoadBalancerNodePorts = nil, nil
		v.Status.Conditions = nil
	case *discovery.EndpointSlice:
		slimMeta(&v.ObjectMeta)
		for i := range v.Endpoints {
			e := &v.Endpoints[i]
			e.Hostname, e.DeprecatedTopology = nil, nil
			if r := e.TargetRef; r != nil {
				e.TargetRef = &v1.ObjectReference{Kind: r.Kind, Namespace: r.Namespace, Name: r.Name}
			}
		}
	default:
		if m, err := meta.Accessor(o); err == nil {
			m.SetManagedFields(nil)
		}
	}
	return o, nil
}

// lastApplied is kubectl's copy of the whole object, in an annotation no proxy reads.
const lastApplied = "kubectl.kubernetes.io/last-applied-configuration"

// slimMeta keeps name, namespace, UID, resource version, labels and annotations (but
// last-applied-configuration).
func slimMeta(m *metav1.ObjectMeta) {
	*m = metav1.ObjectMeta{Name: m.Name, Namespace: m.Namespace, UID: m.UID, ResourceVersion: m.ResourceVersion,
		Labels: m.Labels, Annotations: m.Annotations}
	delete(m.Annotations, lastApplied)
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
