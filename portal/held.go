package portal

import (
	"context"
	"errors"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Held puts a PortHolder in front of rule-based portals: node ports (and local portal IPs) are
// held first, and a service port whose hold failed gets no rules, so it cannot steal traffic from
// the process that owns the port. The other service ports are unaffected.
type Held struct {
	Rules  Portals
	Holder *PortHolder
	Logger logrus.FieldLogger
	// OnConflict, if set, is called for each service port whose hold newly failed (for events).
	OnConflict func(service.ServicePortName, error)

	failing map[service.ServicePortName]string
}

var _ Portals = (*Held)(nil)

// Sync holds the ports, then programs the rules of the service ports that hold theirs.
func (h *Held) Sync(ctx context.Context, specs []Spec) error {
	failed := h.Holder.Sync(specs)
	now := make(map[service.ServicePortName]string, len(failed))
	for name, err := range failed {
		now[name] = err.Error()
		if h.failing[name] != err.Error() { // log a conflict once, not every sync
			if h.Logger != nil {
				h.Logger.WithField("service", name.String()).WithError(err).Error("Port conflict: the service port gets no portal rules")
			}
			if h.OnConflict != nil {
				h.OnConflict(name, err)
			}
		}
	}
	h.failing = now
	return h.Rules.Sync(ctx, WithoutFailed(specs, failed))
}

// Cleanup releases every held port and removes the rules.
func (h *Held) Cleanup(ctx context.Context) error {
	return errors.Join(h.Holder.Close(), h.Rules.Cleanup(ctx))
}
