package proxier

import (
	"fmt"
	"net/netip"
	"sync"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// AccessLog writes one structured line per ended TCP connection or UDP session. The sockets call
// it once, after the connection is closed, so the data path pays nothing per byte or packet.
type AccessLog struct {
	// All turns it on for every service port (--access-log); otherwise only for Services annotated
	// portal-proxy.kubernetes.io/access-log: "true".
	All bool
	Log logrus.FieldLogger
	// Pods, if set, names the pod (namespace/name) behind an endpoint and its node, for the
	// "pod" and "node" fields. The proxier keeps it (Deps.Pods) for the ports whose log is on.
	Pods *PodIndex
}

func (a AccessLog) on(p *service.Port) bool { return a.Log != nil && (a.All || p.AccessLog) }

// OnEnd returns the end hook of a service port's proxy socket (TCP or UDP, after p.Protocol), or
// nil when its access log is off.
func (a AccessLog) OnEnd(p *service.Port) func(flow.Info) {
	if !a.on(p) {
		return nil
	}
	a.Pods.watch(p.Name)
	name, udpPort := p.Name.String(), p.Protocol == service.UDP
	proto, msg := "tcp", "connection closed"
	if udpPort {
		proto, msg = "udp", "session ended"
	}
	return func(f flow.Info) {
		fields := logrus.Fields{
			"access": proto, "service": name, "client": f.Client.String(), "endpoint": addrOrNone(f.Endpoint),
			"bytes_to_endpoint": f.BytesToEndpoint, "bytes_to_client": f.BytesToClient,
			"duration": f.Duration.String(), "reason": f.End.String(),
		}
		if udpPort {
			fields["packets_to_endpoint"], fields["packets_to_client"] = f.PacketsToEndpoint, f.PacketsToClient
		} else {
			fields["dial_attempts"] = f.DialAttempts
		}
		if f.Err != nil {
			fields["error"] = f.Err.Error()
		}
		if f.Transparent { // the endpoint saw the client's own address (else the node's)
			fields["source"] = "client"
		}
		if f.Endpoint.IsValid() {
			if r := a.Pods.lookup(p.Name, f.Endpoint); r != (podRef{}) {
				fields["pod"], fields["node"] = orNone(r.pod), orNone(r.node)
			}
		}
		a.Log.WithFields(fields).Info(msg)
	}
}

// SocketConfigs applies the access log to a SocketConfig's per-port hooks.
func (a AccessLog) SocketConfigs(cfg SocketConfig) SocketConfig {
	cfg.TCPConfigFor = func(p *service.Port, c tcp.Config) tcp.Config {
		c.OnEnd = a.OnEnd(p)
		return c
	}
	cfg.UDPConfigFor = func(p *service.Port, c udp.Config) udp.Config {
		c.OnEnd = a.OnEnd(p)
		return c
	}
	return cfg
}

func addrOrNone(a netip.AddrPort) string {
	if !a.IsValid() {
		return "none"
	}
	return fmt.Sprint(a)
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// PodIndex names the pod (the EndpointSlice endpoint's targetRef) and node behind each endpoint
// of the service ports whose access log is on. Only those ports are kept, and they are kept up to
// date when their endpoints change, not looked up per connection: the access log line of a
// connection that ends after its pod was deleted (a drain) still names the pod, so endpoints that
// left are remembered, up to maxDeparted per port. Ports without the access log cost nothing.
type PodIndex struct {
	mu    sync.RWMutex
	ports map[service.ServicePortName]*podPort
	// source gives a port's current endpoints, for a port watched after its endpoints came in
	// (the proxier sets it).
	source func(service.ServicePortName) []service.Endpoint
}

type podPort struct {
	refs     map[netip.AddrPort]podRef // nil until filled
	departed int                       // entries of endpoints that left, kept for late lines
}

type podRef struct{ pod, node string }

// maxDeparted bounds the endpoints a port remembers after they left.
const maxDeparted = 1024

// NewPodIndex returns an empty index; give it to AccessLog.Pods and Deps.Pods.
func NewPodIndex() *PodIndex { return &PodIndex{ports: map[service.ServicePortName]*podPort{}} }

// watch starts keeping name (its access log is on); a nil index does nothing.
func (x *PodIndex) watch(name service.ServicePortName) {
	if x == nil {
		return
	}
	x.mu.Lock()
	if x.ports[name] == nil {
		x.ports[name] = &podPort{}
	}
	x.mu.Unlock()
}

// update gives a watched port its current endpoints, remembering those that left.
func (x *PodIndex) update(name service.ServicePortName, eps []service.Endpoint) {
	if x == nil {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	pp := x.ports[name]
	if pp == nil {
		return
	}
	refs := podRefsOf(eps)
	departed := 0
	if pp.departed < maxDeparted {
		for ep, r := range pp.refs {
			if _, ok := refs[ep]; !ok {
				refs[ep] = r
				departed++
			}
		}
	}
	pp.refs, pp.departed = refs, departed
}

// lookup names the pod behind ep; the zero podRef if it is not known.
func (x *PodIndex) lookup(name service.ServicePortName, ep netip.AddrPort) podRef {
	if x == nil {
		return podRef{}
	}
	x.mu.RLock()
	pp := x.ports[name]
	var r podRef
	filled := pp != nil && pp.refs != nil
	if filled {
		r = pp.refs[ep]
	}
	x.mu.RUnlock()
	if filled || pp == nil || x.source == nil {
		return r
	}
	x.update(name, x.source(name))
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.ports[name].refs[ep]
}

func podRefsOf(eps []service.Endpoint) map[netip.AddrPort]podRef {
	refs := make(map[netip.AddrPort]podRef, len(eps))
	for _, e := range eps {
		var r podRef
		if e.TargetRef.Name != "" {
			r.pod = e.TargetRef.String()
		}
		r.node = e.NodeName
		if r != (podRef{}) {
			refs[e.Addr] = r
		}
	}
	return refs
}
