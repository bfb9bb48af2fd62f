package proxier

import (
	"net/netip"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// SocketConfig tunes the real proxy sockets.
type SocketConfig struct {
	TCP tcp.Config
	UDP udp.Config
	// TCPConfigFor and UDPConfigFor, if set, adjust the config per service port (for example to
	// attach an access log only where a Service asks for it).
	TCPConfigFor func(*service.Port, tcp.Config) tcp.Config
	UDPConfigFor func(*service.Port, udp.Config) udp.Config
}

// RealSockets returns the SocketFactory that opens real TCP and UDP proxy sockets.
func RealSockets(cfg SocketConfig) SocketFactory {
	return func(p *service.Port, picker Picker) ProxySocket {
		if p.Protocol == service.UDP {
			c := cfg.UDP
			if cfg.UDPConfigFor != nil {
				c = cfg.UDPConfigFor(p, c)
			}
			return udpSocket{udp.New(p.Name, picker, c)}
		}
		c := cfg.TCP
		if cfg.TCPConfigFor != nil {
			c = cfg.TCPConfigFor(p, c)
		}
		return tcpSocket{tcp.New(p.Name, picker, c)}
	}
}

// tcpSocket adapts a TCP proxy to ProxySocket.
type tcpSocket struct{ *tcp.Proxy }

func (s tcpSocket) DropEndpoint(ep netip.AddrPort) int { return s.CloseConnsTo(ep) }

// udpSocket adapts a UDP proxy to ProxySocket.
type udpSocket struct{ *udp.Proxy }

func (s udpSocket) DropEndpoint(ep netip.AddrPort) int { return s.CloseSessionsTo(ep) }

// Shutdown ends the sessions too (Close already does for UDP).
func (s udpSocket) Shutdown() { _ = s.Close() }

// shutdowner is implemented by sockets that can end their established connections at exit.
type shutdowner interface{ Shutdown() }
