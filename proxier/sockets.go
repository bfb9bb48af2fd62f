package proxier

import (
	"iter"
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/debugview"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/metrics"
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
	// Flows, if set, takes every socket's flow events (the live flow stream); Node names this
	// node in them.
	Flows FlowSink
	Node  string
	// Transparent, if set, says per connection or session whether a port whose SourceMode is
	// transparent dials from the client's address (portal/transparent.Policy).
	Transparent flow.SourcePolicy
}

// RealSockets returns the SocketFactory that opens real TCP and UDP proxy sockets.
func RealSockets(cfg SocketConfig) SocketFactory {
	return func(p *service.Port, picker Picker, allow func(netip.Addr) bool) ProxySocket {
		if p.Protocol == service.UDP {
			c := cfg.UDP
			if cfg.UDPConfigFor != nil {
				c = cfg.UDPConfigFor(p, c)
			}
			c.Allow = allow
			if cfg.Flows != nil {
				c.Flows = cfg.Flows.ForPort(flowPort(p, cfg.Node, flow.PathSocket))
			}
			if cfg.Transparent != nil && p.SourceMode == service.SourceTransparent {
				c.Source = cfg.Transparent
			}
			return udp.New(p.Name, picker, c)
		}
		c := cfg.TCP
		if cfg.TCPConfigFor != nil {
			c = cfg.TCPConfigFor(p, c)
		}
		c.Allow = allow
		if cfg.Flows != nil {
			c.Flows = cfg.Flows.ForPort(flowPort(p, cfg.Node, flow.PathSocket))
		}
		c.ProxyProtocol, c.HoldTimeout = proxyProtocolVersion(p.ProxyProtocol), p.HoldTimeout
		if cfg.Transparent != nil && p.SourceMode == service.SourceTransparent {
			c.Source = cfg.Transparent
		}
		return tcp.New(p.Name, picker, c)
	}
}

// starter is implemented by sockets that can serve without a goroutine waiting in Run (a TCP
// proxy on the io_uring engine, whose rings accept): Start then reports true and the socket
// serves until Close. At 10,000 service ports that is 10,000 goroutine stacks fewer (24 MB).
type starter interface {
	Start() (bool, error)
}

// shutdowner is implemented by sockets that can end their established connections at exit.
type shutdowner interface{ Shutdown() }

// observed is what the metrics collector and the debug views read from a socket. Both real proxies
// implement it; a multiSocket aggregates its members.
type observed interface {
	Stats() flow.Stats
	Live() []flow.Info
}

var (
	_ ProxySocket = (*tcp.Proxy)(nil)
	_ ProxySocket = (*udp.Proxy)(nil)
	_ shutdowner  = (*tcp.Proxy)(nil)
	_ starter     = (*tcp.Proxy)(nil)
	_ starter     = (*multiSocket)(nil)
	_ shutdowner  = (*udp.Proxy)(nil)
	_ observed    = (*tcp.Proxy)(nil)
	_ observed    = (*udp.Proxy)(nil)
	_ observed    = (*multiSocket)(nil)
	_ refuser     = (*tcp.Proxy)(nil)
	_ refuser     = (*udp.Proxy)(nil)
	_ refuser     = (*multiSocket)(nil)
)

// socketStats reads the counters of a socket (none for sockets that are not observed, i.e. fakes).
func socketStats(s ProxySocket) (flow.Stats, bool) {
	if o, ok := s.(observed); ok {
		return o.Stats(), true
	}
	return flow.Stats{}, false
}

// connViews lists the live flows of a socket for the debug views.
func connViews(s ProxySocket, name, protocol string, now time.Time) []debugview.ConnView {
	o, ok := s.(observed)
	if !ok {
		return nil
	}
	var out []debugview.ConnView
	for _, f := range o.Live() {
		out = append(out, debugview.ConnView{Service: name, Protocol: protocol, Client: f.Client.String(), Endpoint: addrOrNone(f.Endpoint),
			Age: now.Sub(f.Start).Round(time.Millisecond).String(), BytesToEndpoint: f.BytesToEndpoint, BytesToClient: f.BytesToClient})
	}
	return out
}

// listenAddrs are the addresses a socket listens on (a multiSocket has several).
func listenAddrs(s ProxySocket) []string {
	addrs := []netip.AddrPort{s.Addr()}
	if m, ok := s.(*multiSocket); ok {
		addrs = m.addrs()
	}
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a.String()
	}
	return out
}

// observedSocket is what the metrics and the debug views read of a port: its socket, together with
// its external-traffic socket when it has one.
func (a *activePort) observedSocket() ProxySocket {
	if a.ext == nil {
		return a.sock
	}
	return &multiSocket{socks: []ProxySocket{a.sock, a.ext.sock}}
}

// The traffic series (package metrics) read what Traffic yields at every scrape.
var _ metrics.TrafficSource = (*Proxier)(nil)

// Traffic yields every open service port with its sockets' counters and its balancer's state,
// read now: the metrics collector calls it at each scrape. It walks the open ports under the
// paths' read lock, copying nothing (at 10,000 ports a snapshot of them and of every endpoint
// list was most of a scrape's garbage), so yield must be quick and must not call back into the
// proxier: a sync waits for the walk.
func (p *Proxier) Traffic() iter.Seq[metrics.PortTraffic] {
	return func(yield func(metrics.PortTraffic) bool) {
		d := p.paths
		d.mu.RLock()
		defer d.mu.RUnlock()
		for _, a := range d.socketPaths() {
			if !yield(p.portTraffic(a)) {
				return
			}
		}
	}
}

// portTraffic reads what the traffic series show of one open port; the caller holds paths.mu.
func (p *Proxier) portTraffic(a *activePort) metrics.PortTraffic {
	t := metrics.PortTraffic{Name: a.port.Name, Protocol: a.port.Protocol, Holds: a.port.Holds()}
	if b := p.deps.Balancer.Lookup(a.port.Name); b != nil {
		t.Balanced, t.Endpoints = true, b.NumEndpoints()
	}
	if t.Outlier = a.port.Balancing.Outlier.On(); t.Outlier {
		t.Ejections, t.Ejected = p.eps.outliers(a.port.Name)
	}
	// As observedSocket's multiSocket would, without building one: with an external-traffic
	// socket the port is observed, and its counters are the sum of both sockets'.
	if a.ext != nil {
		ext, extObserved := socketStats(a.ext.sock)
		st, ok := socketStats(a.sock)
		if ok {
			t.Stats = st
		}
		if extObserved {
			t.Stats.Add(ext)
		}
		t.Observed = true
	} else {
		t.Stats, t.Observed = socketStats(a.sock)
	}
	if t.Drain = a.port.DrainTimeout > 0; t.Drain && t.Observed {
		t.Drained = t.Stats.Ended[flow.DrainTimeout]
	}
	if t.Transparent = a.port.SourceMode == service.SourceTransparent; t.Transparent && t.Observed {
		t.TransparentDials, t.TransparentFallbacks = t.Stats.TransparentDials, t.Stats.TransparentFallbacks
	}
	return t
}

// activeList snapshots the open sockets (copies, so readers need no lock afterwards).
func (d *dataPaths) activeList() []activePort {
	d.mu.RLock()
	defer d.mu.RUnlock()
	out := make([]activePort, 0, len(d.byName))
	for _, a := range d.socketPaths() {
		out = append(out, *a)
	}
	return out
}
