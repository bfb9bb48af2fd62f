package proxier

import (
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
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

// observed is what the metrics collector and the debug views read from a socket. The real
// sockets implement it; a multiSocket aggregates its members.
type observed interface {
	traffic() (*tcp.Stats, *udp.Stats)
	live(name string, now time.Time) []ConnView
	addrs() []netip.AddrPort
}

var (
	_ observed = tcpSocket{}
	_ observed = udpSocket{}
	_ observed = (*multiSocket)(nil)
)

func (s tcpSocket) traffic() (*tcp.Stats, *udp.Stats) { st := s.Stats(); return &st, nil }
func (s udpSocket) traffic() (*tcp.Stats, *udp.Stats) { st := s.Stats(); return nil, &st }
func (s tcpSocket) addrs() []netip.AddrPort           { return []netip.AddrPort{s.Addr()} }
func (s udpSocket) addrs() []netip.AddrPort           { return []netip.AddrPort{s.Addr()} }

func (s tcpSocket) live(name string, now time.Time) []ConnView {
	var out []ConnView
	for _, c := range s.Conns() {
		out = append(out, ConnView{Service: name, Protocol: "TCP", Client: c.Client.String(), Endpoint: c.Endpoint.String(),
			Age: now.Sub(c.Start).Round(time.Millisecond).String(), BytesToEndpoint: uint64(c.BytesIn), BytesToClient: uint64(c.BytesOut)})
	}
	return out
}

func (s udpSocket) live(name string, now time.Time) []ConnView {
	var out []ConnView
	for _, c := range s.Sessions() {
		out = append(out, ConnView{Service: name, Protocol: "UDP", Client: c.Client.String(), Endpoint: c.Endpoint.String(),
			Age: now.Sub(c.Started).Round(time.Millisecond).String(), BytesToEndpoint: c.BytesToEndpoint, BytesToClient: c.BytesFromEndpoint})
	}
	return out
}
