package proxier

import (
	"fmt"
	"net/netip"

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
	// "pod" and "node" fields (Proxier.EndpointPod).
	Pods func(service.ServicePortName, netip.AddrPort) (pod, node string)
}

func (a AccessLog) on(p *service.Port) bool { return a.Log != nil && (a.All || p.AccessLog) }

// OnEnd returns the end hook of a service port's proxy socket (TCP or UDP, after p.Protocol), or
// nil when its access log is off.
func (a AccessLog) OnEnd(p *service.Port) func(flow.Info) {
	if !a.on(p) {
		return nil
	}
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
		if a.Pods != nil && f.Endpoint.IsValid() {
			pod, node := a.Pods(p.Name, f.Endpoint)
			if pod != "" {
				fields["pod"] = pod
			}
			if node != "" {
				fields["node"] = node
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
