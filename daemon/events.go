package daemon

import (
	"context"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// serviceEvents records Warning events against Services. client-go's broadcaster aggregates
// repeats and rate-limits per object, so a flapping failure cannot flood the API server. Without
// a cluster (--services-file) events only reach the log, which the callers already wrote.
type serviceEvents struct {
	recorder record.EventRecorder
	// uid finds a Service's UID, so that the event's object reference is complete and `kubectl
	// describe service` shows it (it selects events by UID). Nil or "" leaves the UID out.
	uid func(service.NamespacedName) string
}

// newServiceEvents starts the broadcaster (Run calls it); stop shuts it down. Without a cluster
// (c nil) neither does anything.
func newServiceEvents(ctx context.Context, c kubernetes.Interface, node string, log logrus.FieldLogger) (events *serviceEvents, stop func()) {
	if c == nil {
		return &serviceEvents{}, func() {}
	}
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.CoreV1().Events("")})
	b.StartEventWatcher(func(e *v1.Event) {
		log.WithFields(logrus.Fields{"reason": e.Reason, "object": e.InvolvedObject.Namespace + "/" + e.InvolvedObject.Name}).Debug("Event recorded")
	})
	return &serviceEvents{recorder: b.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kube-portal-proxy", Host: node})}, b.Shutdown
}

// Warning records a Warning event on the Service of a service port.
func (e *serviceEvents) Warning(name service.ServicePortName, reason, message string) {
	e.record(name.ServiceName(), reason, "service port "+name.String()+": "+message)
}

// ServiceWarning records a Warning event on a Service.
func (e *serviceEvents) ServiceWarning(name service.NamespacedName, reason, message string) {
	e.record(name, reason, message)
}

func (e *serviceEvents) record(name service.NamespacedName, reason, message string) {
	if e.recorder == nil {
		return
	}
	ref := &v1.ObjectReference{Kind: "Service", APIVersion: "v1", Namespace: name.Namespace, Name: name.Name}
	if e.uid != nil {
		ref.UID = types.UID(e.uid(name))
	}
	e.recorder.Event(ref, v1.EventTypeWarning, reason, message)
}
