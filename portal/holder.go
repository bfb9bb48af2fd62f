package portal

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// HolderConfig configures a PortHolder.
type HolderConfig struct {
	// LocalAddrs lists the node's addresses; nil means the addresses of every interface.
	LocalAddrs func() ([]netip.Addr, error)
	// Listen opens the socket that holds a port (the zero Addr means every address); nil means a
	// real TCP listener or UDP socket.
	Listen func(proto service.Protocol, addr netip.AddrPort) (io.Closer, error)
	Logger logrus.FieldLogger
}

// PortHolder binds and holds a real socket on each node port, and on each portal IP:port whose IP
// is local, so no other process can take a port the portal rules send elsewhere. The sockets are
// never served: the rules redirect the traffic before it reaches them.
type PortHolder struct {
	cfg HolderConfig

	mu        sync.Mutex
	held      map[holdKey]holding
	lastLocal []netip.Addr
}

type holdKey struct {
	addr  netip.Addr // zero: every address
	port  uint16
	proto service.Protocol
}

func (k holdKey) String() string {
	host := ""
	if k.addr.IsValid() {
		host = k.addr.String()
	}
	return net.JoinHostPort(host, strconv.Itoa(int(k.port))) + "/" + strings.ToLower(string(k.proto))
}

type holding struct {
	owner service.ServicePortName
	sock  io.Closer
}

// NewPortHolder returns a holder that holds nothing yet.
func NewPortHolder(cfg HolderConfig) *PortHolder {
	if cfg.LocalAddrs == nil {
		cfg.LocalAddrs = interfaceAddrs
	}
	if cfg.Listen == nil {
		cfg.Listen = ListenHold
	}
	if cfg.Logger == nil {
		cfg.Logger = DiscardLogger()
	}
	return &PortHolder{cfg: cfg, held: map[holdKey]holding{}}
}

// Sync holds exactly the ports specs need and releases the rest. A port already held for one
// service port, or taken by another process, is an error for the service port that wants it, and
// for that service port only; the returned map is empty when every port is held. Failed ports are
// tried again on the next Sync.
func (h *PortHolder) Sync(specs []Spec) map[service.ServicePortName]error {
	h.mu.Lock()
	defer h.mu.Unlock()
	local := h.localAddrs()
	failed := map[service.ServicePortName]error{}

	sorted := slices.Clone(specs)
	slices.SortFunc(sorted, CompareSpecs)
	claims := map[holdKey][]service.ServicePortName{}
	var order []holdKey
	for i := range sorted {
		for _, k := range wantedHolds(&sorted[i], local) {
			if len(claims[k]) == 0 {
				order = append(order, k)
			}
			claims[k] = append(claims[k], sorted[i].Name)
		}
	}
	wanted := make(map[holdKey]service.ServicePortName, len(claims))
	for _, k := range order {
		owners := claims[k]
		winner := owners[0]
		if cur, ok := h.held[k]; ok && slices.Contains(owners, cur.owner) {
			winner = cur.owner // whoever holds a port keeps it
		}
		wanted[k] = winner
		for _, o := range owners {
			if o != winner {
				failed[o] = errors.Join(failed[o], fmt.Errorf("portal %s: port conflict on %s: already held for %s", o, k, winner))
			}
		}
	}

	for k, cur := range h.held {
		if owner, ok := wanted[k]; !ok || owner != cur.owner {
			h.release(k)
		}
	}
	for _, k := range order {
		owner := wanted[k]
		if _, ok := h.held[k]; ok {
			continue
		}
		sock, err := h.cfg.Listen(k.proto, netip.AddrPortFrom(k.addr, k.port))
		if err != nil {
			failed[owner] = errors.Join(failed[owner], fmt.Errorf("portal %s: can't hold port %s: %w", owner, k, err))
			continue
		}
		h.held[k] = holding{owner: owner, sock: sock}
	}
	return failed
}

func (h *PortHolder) release(k holdKey) {
	if err := h.held[k].sock.Close(); err != nil {
		h.cfg.Logger.WithError(err).WithField("portal", k.String()).Warn("Closing held port")
	}
	delete(h.held, k)
}

// localAddrs lists the node's addresses; on failure it keeps the last good answer so held ports
// do not flap.
func (h *PortHolder) localAddrs() []netip.Addr {
	addrs, err := h.cfg.LocalAddrs()
	if err != nil {
		h.cfg.Logger.WithError(err).Warn("Listing local addresses; keeping the previous list")
		return h.lastLocal
	}
	h.lastLocal = addrs
	return addrs
}

// wantedHolds is every port s needs held: its node port on every address, and its service port on
// each portal IP that is local (unless the node port already covers that port).
func wantedHolds(s *Spec, local []netip.Addr) []holdKey {
	if s.Protocol != service.TCP && s.Protocol != service.UDP {
		return nil
	}
	var keys []holdKey
	if s.NodePort != 0 {
		keys = append(keys, holdKey{port: s.NodePort, proto: s.Protocol})
	}
	if s.Port == 0 || s.Port == s.NodePort {
		return keys
	}
	for _, ips := range [][]netip.Addr{s.ClusterIPs, s.ExternalIPs, s.LoadBalancerIPs} {
		for _, ip := range ips {
			ip = ip.Unmap()
			k := holdKey{addr: ip, port: s.Port, proto: s.Protocol}
			if ip.IsValid() && slices.Contains(local, ip) && !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	return keys
}

// Held lists the held ports ("addr:port/proto owner"), sorted, for a debug view.
func (h *PortHolder) Held() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]string, 0, len(h.held))
	for k, v := range h.held {
		out = append(out, k.String()+" "+v.owner.String())
	}
	slices.Sort(out)
	return out
}

// Close releases every held port.
func (h *PortHolder) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	var errs []error
	for k, v := range h.held {
		if err := v.sock.Close(); err != nil {
			errs = append(errs, fmt.Errorf("portal: close held port %s: %w", k, err))
		}
		delete(h.held, k)
	}
	return errors.Join(errs...)
}

// WithoutFailed returns specs minus the service ports in failed, so a port whose hold failed gets
// no portal rules (the legacy proxy stopped its portal setup the same way).
func WithoutFailed(specs []Spec, failed map[service.ServicePortName]error) []Spec {
	if len(failed) == 0 {
		return specs
	}
	out := make([]Spec, 0, len(specs))
	for _, s := range specs {
		if _, bad := failed[s.Name]; !bad {
			out = append(out, s)
		}
	}
	return out
}

// ListenHold is how a PortHolder holds a port by default: a real TCP listener or UDP socket on
// addr (the zero address means every address, of both families where the node has IPv6).
func ListenHold(proto service.Protocol, addr netip.AddrPort) (io.Closer, error) {
	hostport := ":" + strconv.Itoa(int(addr.Port()))
	if addr.Addr().IsValid() {
		hostport = addr.String()
	}
	if proto == service.UDP {
		return net.ListenPacket("udp", hostport)
	}
	return net.Listen("tcp", hostport)
}

func interfaceAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("list interface addresses: %w", err)
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, p.Addr().Unmap())
		}
	}
	return out, nil
}
