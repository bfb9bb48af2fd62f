package daemon

import (
	"context"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
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
	client kubernetes.Interface // nil: no cluster
	node   string
	log    logrus.FieldLogger

	// recorder is set by start, before the proxier runs; nil until then and without a cluster.
	recorder record.EventRecorder
}

// newServiceEvents builds the recorder's owner; start starts it.
func newServiceEvents(c kubernetes.Interface, node string, log logrus.FieldLogger) *serviceEvents {
	return &serviceEvents{client: c, node: node, log: log}
}

// start begins sending events to the API server; stop ends it and waits for the broadcaster's
// goroutines. Without a cluster both do nothing.
func (e *serviceEvents) start(ctx context.Context) (stop func()) {
	if e.client == nil {
		return func() {}
	}
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: e.client.CoreV1().Events("")})
	b.StartEventWatcher(func(ev *v1.Event) {
		e.log.WithFields(logrus.Fields{"reason": ev.Reason, "object": ev.InvolvedObject.Namespace + "/" + ev.InvolvedObject.Name}).Debug("Event recorded")
	})
	e.recorder = b.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kube-portal-proxy", Host: e.node})
	return b.Shutdown
}

// Warning records a Warning event on the Service of a service port.
func (e *serviceEvents) Warning(name service.ServicePortName, reason, message string) {
	if e.recorder == nil {
		return
	}
	ref := &v1.ObjectReference{Kind: "Service", APIVersion: "v1", Namespace: name.Namespace, Name: name.Name}
	e.recorder.Eventf(ref, v1.EventTypeWarning, reason, "service port %s: %s", name, message)
}
