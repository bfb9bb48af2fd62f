package proxier

// affinity.go: a planned restart keeps ClientIP session affinity. The successor of a hand-over
// is given its predecessor's affinity table (InheritAffinity) and puts each service port's sticky
// clients into the port's balancer when its first endpoints are set, before any held or new
// connection of that port picks: a client goes on to the endpoint it had, as long as that
// endpoint is still in use and within the port's timeout.

import (
	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// inheritedAffinity is the predecessor's table until the ports take it; guarded by endpointApplier.mu.
type inheritedAffinity struct {
	pending       map[service.ServicePortName][]loadbalancer.AffinityEntry
	offered, took int
}

// InheritAffinity hands the proxier the affinity table of the process it takes over from, per
// balancer entry (a split port's external entry has its own name). Entries are checked when
// taken (loadbalancer.ImportAffinity); what no port took by the end of the first sync is dropped.
// Call it before Run.
func (p *Proxier) InheritAffinity(entries map[service.ServicePortName][]loadbalancer.AffinityEntry) {
	e := p.eps
	e.mu.Lock()
	defer e.mu.Unlock()
	e.inherited.pending = entries
	for _, es := range entries {
		e.inherited.offered += len(es)
	}
}

// takeInherited puts a balancer entry's inherited clients into its table once it has endpoints.
// Called with e.mu held, after SetAffinity and SetEndpoints, before held connections wake.
func (e *endpointApplier) takeInherited(key service.ServicePortName, usable int) {
	es, ok := e.inherited.pending[key]
	if !ok || usable == 0 { // a Service often comes before its EndpointSlices
		return
	}
	delete(e.inherited.pending, key)
	e.inherited.took += e.balancer.ImportAffinity(key, es)
}

// endInherited drops what no port took, at the end of the first sync, and says what was kept.
func (e *endpointApplier) endInherited() {
	e.mu.Lock()
	in := e.inherited
	e.inherited = inheritedAffinity{}
	e.mu.Unlock()
	if in.offered == 0 {
		return
	}
	e.log.WithFields(logrus.Fields{"entries": in.offered, "kept": in.took, "dropped": in.offered - in.took}).
		Info("Kept the predecessor's ClientIP affinity (entries of endpoints no longer in use, past their timeout, or of service ports gone are dropped)")
}
