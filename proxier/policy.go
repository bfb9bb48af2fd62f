package proxier

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// The balancer hears how its picks turn out from both proxies (least-connections counts).
var (
	_ tcp.Observer = (*loadbalancer.Service)(nil)
	_ udp.Observer = (*loadbalancer.Service)(nil)
)

// ReasonEndpointEjected is the Warning event recorded on a Service when outlier detection takes
// one of its endpoints out of rotation.
const ReasonEndpointEjected = "EndpointEjected"

// onEjection logs an ejection and records a Warning event on the Service. The balancer calls it
// from the connection that saw the last failure, once per ejection.
func (p *Proxier) onEjection(e loadbalancer.Ejection) {
	name := e.Service
	name.Port = strings.TrimSuffix(name.Port, externalName(service.ServicePortName{}).Port)
	what := "failed dials"
	if e.Reset {
		what = "connections reset at once"
	}
	p.log.WithFields(logrus.Fields{
		"service": name.String(), "endpoint": e.Endpoint.String(), "failures": e.Failures, "cause": what,
		"ejected_for": e.Duration.String(), "ejections": e.Ejections,
	}).Warn("Endpoint ejected from the rotation by outlier detection")
	if p.deps.Event != nil {
		p.deps.Event(name, ReasonEndpointEjected, fmt.Sprintf("endpoint %s ejected for %s after %d %s (ejection %d in a row)",
			e.Endpoint, e.Duration, e.Failures, what, e.Ejections))
	}
}

// balancingView is how the debug view shows a port's balancing policy.
func balancingView(b service.Balancing) debugview.BalancingView {
	v := debugview.BalancingView{Algorithm: string(b.Algorithm)}
	if v.Algorithm == "" {
		v.Algorithm = string(service.RoundRobin)
	}
	if o := b.Outlier; o.On() {
		v.OutlierConsecutiveFailures = o.ConsecutiveFailures
		v.OutlierEjectionTime = o.EjectionTime.String()
		v.OutlierMaxEjectionPercent = o.MaxEjectionPercent
	}
	if b.SlowStart > 0 {
		v.SlowStart = b.SlowStart.String()
	}
	return v
}

// outliers sums the outlier detection counters of a port's balancers (cluster and external).
func (e *endpointApplier) outliers(name service.ServicePortName) (total uint64, ejected int) {
	for _, key := range []service.ServicePortName{name, externalName(name)} {
		if b := e.balancer.Lookup(key); b != nil {
			t, e := b.Outliers()
			total, ejected = total+t, ejected+e
		}
	}
	return total, ejected
}

// proxyProtocolVersion is the tcp package's spelling of a port's PROXY protocol.
func proxyProtocolVersion(pp service.ProxyProtocol) proxyprotocol.Version {
	switch pp {
	case service.ProxyProtocolV1:
		return proxyprotocol.V1
	case service.ProxyProtocolV2:
		return proxyprotocol.V2
	}
	return proxyprotocol.Off
}

// holder is a proxy socket that holds connections while its port has no endpoint (tcp.Proxy; a
// multiSocket passes it on to its members).
type holder interface {
	WakeHeld()
}

var (
	_ holder = (*tcp.Proxy)(nil)
	_ holder = (*multiSocket)(nil)
)

// WakeHeld wakes the held connections of every member.
func (m *multiSocket) WakeHeld() {
	for _, s := range m.socks {
		if h, ok := s.(holder); ok {
			h.WakeHeld()
		}
	}
}

// wakeHeld tells the socket of a holding port's class of traffic that it has endpoints again, so
// its held connections are dialed now. Called after the balancer has them.
func (e *endpointApplier) wakeHeld(port *service.Port, external bool, usable []netip.AddrPort) {
	if !port.Holds() || len(usable) == 0 {
		return
	}
	if h, ok := e.socketOf(port.Name, external).(holder); ok {
		h.WakeHeld()
	}
}

// connectionPolicyView shows a port's connection policies, with the live held count of its
// sockets when it holds.
func connectionPolicyView(v *debugview.ServiceView, port *service.Port, open map[service.ServicePortName]activePort) {
	v.ProxyProtocol = string(port.ProxyProtocol)
	if port.SourceMode == service.SourceTransparent {
		v.SourceMode = string(port.SourceMode)
	}
	if !port.Holds() {
		return
	}
	v.Hold = &debugview.HoldView{Timeout: port.HoldTimeout.String(), Limit: tcp.DefaultHoldLimit}
	for _, t := range []*debugview.TrafficView{v.Internal, v.External} {
		if t != nil && len(t.Endpoints) == 0 {
			t.Held = true
		}
	}
	if a, ok := open[port.Name]; ok {
		if st, ok := socketStats(a.observedSocket()); ok {
			v.Hold.Held = st.Held
		}
	}
}
