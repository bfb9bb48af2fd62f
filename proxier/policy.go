package proxier

import (
	"errors"
	"strings"
	"sync"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// The balancer hears how its picks turn out from both proxies (least-connections counts).
var (
	_ tcp.Observer = (*loadbalancer.Service)(nil)
	_ udp.Observer = (*loadbalancer.Service)(nil)
)

// ReasonInvalidAnnotation is the Warning event recorded on a Service whose
// portal-proxy.kubernetes.io/ annotations do not parse.
const ReasonInvalidAnnotation = "InvalidAnnotation"

// annotationWarnings remembers what was last reported about each Service's annotations, so that
// an unchanged bad value (every resync, every unrelated update) is not reported again.
type annotationWarnings struct {
	mu   sync.Mutex
	last map[service.NamespacedName]string
}

// changed records the Service's annotation errors (nil for none) and reports whether they differ
// from the last ones.
func (w *annotationWarnings) changed(name service.NamespacedName, errs []error) (string, bool) {
	var msgs []string
	for _, err := range errs {
		if errors.Is(err, ErrInvalidAnnotation) {
			msgs = append(msgs, err.Error())
		}
	}
	msg := strings.Join(msgs, "; ")
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.last == nil {
		w.last = map[service.NamespacedName]string{}
	}
	if w.last[name] == msg {
		return msg, false
	}
	if msg == "" {
		delete(w.last, name)
	} else {
		w.last[name] = msg
	}
	return msg, true
}

// warnAnnotations records a Warning event on a Service when its annotation errors change to a
// new non-empty set. (The errors themselves are logged with the other conversion errors.)
func (p *Proxier) warnAnnotations(name service.NamespacedName, errs []error) {
	msg, changed := p.annotations.changed(name, errs)
	if !changed || msg == "" || p.deps.Event == nil {
		return
	}
	p.deps.Event(service.ServicePortName{Namespace: name.Namespace, Name: name.Name}, ReasonInvalidAnnotation, msg)
}

// balancingView is how the debug view spells a port's balancing policy.
func balancingView(b service.Balancing) string {
	if b.Algorithm == "" {
		return string(service.RoundRobin)
	}
	return string(b.Algorithm)
}
