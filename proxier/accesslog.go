package proxier

import (
	"fmt"
	"net/netip"

	"github.com/sirupsen/logrus"

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
}

func (a AccessLog) on(p *service.Port) bool { return a.Log != nil && (a.All || p.AccessLog) }

// TCP returns the OnClose hook for a service port, or nil when its access log is off.
func (a AccessLog) TCP(p *service.Port) func(tcp.ConnInfo) {
	if !a.on(p) {
		return nil
	}
	name := p.Name.String()
	return func(c tcp.ConnInfo) {
		f := logrus.Fields{
			"access": "tcp", "service": name, "client": c.Client.String(), "endpoint": addrOrNone(c.Endpoint),
			"bytes_to_endpoint": c.BytesIn, "bytes_to_client": c.BytesOut, "duration": c.Duration.String(),
			"reason": c.End.String(), "dial_attempts": c.DialAttempts,
		}
		if c.Err != nil {
			f["error"] = c.Err.Error()
		}
		a.Log.WithFields(f).Info("connection closed")
	}
}

// UDP returns the OnSessionEnd hook for a service port, or nil when its access log is off.
func (a AccessLog) UDP(p *service.Port) func(udp.SessionInfo) {
	if !a.on(p) {
		return nil
	}
	name := p.Name.String()
	return func(s udp.SessionInfo) {
		a.Log.WithFields(logrus.Fields{
			"access": "udp", "service": name, "client": s.Client.String(), "endpoint": addrOrNone(s.Endpoint),
			"packets_to_endpoint": s.PacketsToEndpoint, "bytes_to_endpoint": s.BytesToEndpoint,
			"packets_to_client": s.PacketsFromEndpoint, "bytes_to_client": s.BytesFromEndpoint,
			"duration": s.Duration.String(), "reason": string(s.Reason),
		}).Info("session ended")
	}
}

// SocketConfigs applies the access log to a SocketConfig's per-port hooks.
func (a AccessLog) SocketConfigs(cfg SocketConfig) SocketConfig {
	cfg.TCPConfigFor = func(p *service.Port, c tcp.Config) tcp.Config {
		c.OnClose = a.TCP(p)
		return c
	}
	cfg.UDPConfigFor = func(p *service.Port, c udp.Config) udp.Config {
		c.OnSessionEnd = a.UDP(p)
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
