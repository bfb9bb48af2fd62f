// Package config holds the proxy's sources of Services and EndpointSlices, as kube-proxy keeps
// them in pkg/proxy/config: the API server's shared informers (InformerSource) and manifests on
// disk (FileSource, --services-file). A source only delivers objects to a Handler; what to do
// with them (record the change, poke the sync runner) is the handler's business.
package config

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// LabelServiceProxyName marks a Service handled by another proxy; kube-proxy skips it too, and
// the informers do not even list it.
const LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"

// ServiceHandler receives Service events. Implementations record the change and return quickly:
// a source delivers events one at a time.
type ServiceHandler interface {
	OnServiceAdd(*v1.Service)
	OnServiceUpdate(old, cur *v1.Service)
	OnServiceDelete(*v1.Service)
	// OnServicesSynced is called once, after the initial list has been delivered.
	OnServicesSynced()
}

// EndpointSliceHandler receives EndpointSlice events, like ServiceHandler.
type EndpointSliceHandler interface {
	OnEndpointSliceAdd(*discovery.EndpointSlice)
	OnEndpointSliceUpdate(old, cur *discovery.EndpointSlice)
	OnEndpointSliceDelete(*discovery.EndpointSlice)
	// OnEndpointSlicesSynced is called once, after the initial list has been delivered.
	OnEndpointSlicesSynced()
}

// Handler receives both kinds of events; every source delivers both.
type Handler interface {
	ServiceHandler
	EndpointSliceHandler
}

// SliceOwner names the Service an EndpointSlice belongs to, from its kubernetes.io/service-name label.
func SliceOwner(s *discovery.EndpointSlice) (service.NamespacedName, error) {
	name := s.Labels[discovery.LabelServiceName]
	if name == "" {
		return service.NamespacedName{}, fmt.Errorf("endpointslice %s/%s: no %s label", s.Namespace, s.Name, discovery.LabelServiceName)
	}
	return service.NamespacedName{Namespace: s.Namespace, Name: name}, nil
}
