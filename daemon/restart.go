package daemon

// restart.go: what a restarted daemon does before anything else so that a restart drops as little
// as possible. After SIGKILL or an OOM kill the portal rules of the old process are still in force
// and point at its proxy ports; the new process reopens those ports (proxier.Reopen) before it has
// read a single Service, so traffic flows again within milliseconds of the start instead of after
// the first full sync.

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
)

// seedReopen hands the proxier the proxy ports the rules in force point at (or, in bind mode,
// where the previous process listened). A failed read-back is logged and costs only the head
// start: the first sync programs everything anyway. It reports whether rules of a previous process
// are in force (iptables mode): then the node can NAT.
func seedReopen(ctx context.Context, pm portalMode, px *proxier.Proxier, log logrus.FieldLogger) (rulesInForce bool) {
	r, ok := pm.(steeredReader)
	if !ok {
		return false
	}
	_, listensOnPortals := pm.(listenPlanner) // bind mode: no rules, the previous sockets' addresses
	seeds, err := r.Steered(ctx)
	if err != nil && !listensOnPortals {
		log.WithError(err).Warn("Cannot read the portal rules in force; proxy sockets open at the first sync")
	} else if err != nil {
		log.WithError(err).Warn("Ignoring the bind state file; proxy sockets open at the first sync")
	}
	if len(seeds) > 0 && !listensOnPortals {
		log.WithField("servicePorts", len(seeds)).Info("Portal rules of a previous process are in force; reopening their proxy ports")
	} else if len(seeds) > 0 {
		log.WithField("servicePorts", len(seeds)).Info("A previous process listened on portal addresses still on the link; reopening its sockets")
	}
	px.Reopen(seeds)
	return len(seeds) > 0 && !listensOnPortals
}

// boundSeeds reads, in bind mode, where the previous process listened (its state file), keeping
// only the service ports whose addresses are all still local: the link kept them, so traffic to
// them is refused until something listens again. An unreadable or unknown file is an error (the
// caller logs it once) and no seed: the first sync opens everything, as without the file.
func boundSeeds(path string, local func() (func(netip.Addr) bool, error)) func(ctx context.Context) ([]proxier.Seed, error) {
	return func(context.Context) ([]proxier.Seed, error) {
		st, err := bind.ReadState(path)
		if err != nil || len(st) == 0 {
			return nil, err
		}
		isLocal, err := local()
		if err != nil {
			return nil, fmt.Errorf("bind state %s: list local addresses: %w", path, err)
		}
		st = bind.Present(st, isLocal)
		seeds := make([]proxier.Seed, 0, len(st))
		for _, s := range st {
			seeds = append(seeds, proxier.Seed{Name: s.Name, Protocol: s.Protocol, ProxyPort: s.Port,
				Listen: s.Listen, External: s.External, LoadBalancerIPs: s.LoadBalancerIPs, SourceRanges: s.SourceRanges})
		}
		return seeds, nil
	}
}

// saveBoundSeeds keeps, after each sync, where the sockets listen in the state file (written only
// when it changed). A failed write is logged when it starts failing, not at every sync.
func saveBoundSeeds(path string, log logrus.FieldLogger) func([]proxier.Seed) {
	f := &bind.StateFile{Path: path}
	failing := false
	return func(seeds []proxier.Seed) {
		st := make([]bind.ListenState, 0, len(seeds))
		for _, s := range seeds {
			st = append(st, bind.ListenState{Name: s.Name, Protocol: s.Protocol, Port: s.ProxyPort, Listen: s.Listen,
				External: s.External, LoadBalancerIPs: s.LoadBalancerIPs, SourceRanges: s.SourceRanges})
		}
		_, err := f.Save(st)
		if err != nil && !failing {
			log.WithError(err).Warn("Cannot write the bind state file; a restart after a crash opens its sockets only at the first sync")
		}
		failing = err != nil
	}
}

// localAddrs lists the addresses of this network namespace's interfaces (the portal link's
// included).
func localAddrs() (func(netip.Addr) bool, error) {
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	set := make(map[netip.Addr]bool, len(ifaddrs))
	for _, a := range ifaddrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			set[p.Addr().Unmap()] = true
		}
	}
	return func(a netip.Addr) bool { return set[a.Unmap()] }, nil
}

// stateWriter saves the bind state off the sync goroutine (encoding 10,000 ports takes tens of
// milliseconds): Offer, called by the sync after each sync that changed something, replaces the
// state waiting to be written; Run writes the latest one.
type stateWriter struct {
	save    func([]proxier.Seed)
	pending chan []proxier.Seed
}

func newStateWriter(save func([]proxier.Seed)) *stateWriter {
	return &stateWriter{save: save, pending: make(chan []proxier.Seed, 1)}
}

// Offer queues seeds for writing, dropping an older state not yet written. It has one caller (the
// sync goroutine), so the send after the drain never blocks.
func (w *stateWriter) Offer(seeds []proxier.Seed) {
	select {
	case <-w.pending:
	default:
	}
	w.pending <- seeds
}

// Run writes until ctx is done (a process that handed over stops writing: its successor owns
// the file).
func (w *stateWriter) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case seeds := <-w.pending:
			w.save(seeds)
		}
	}
}

// snapshotSeeds are, in iptables mode after a crash, the restart snapshot's proxy ports as the
// seeds of the reopen, instead of the rules in force: reading those back (iptables-save of
// 10,000 portals) was the longest step between the exec and the first answer (0.7-1.5 s of
// 1.1-2.5 s beside a CPU hog on 2 cores), while the snapshot is read anyway. They can stand for the
// rules only if a previous process in this mode wrote them, so ok is false, and the caller reads
// the rules, unless every proxy port is in the range this mode allocates from (a bind-mode
// snapshot names service ports: 53, 80, 443), fams is a single family (the snapshot does not
// say which families a port listens in), and no portal link of bind mode is on the node. What
// the snapshot lacks (a port created in the second before the crash) opens at the first sync.
func snapshotSeeds(st *snapshot.State, fams []portal.Family, inRange func(uint16) bool, bindLink bool) (seeds []proxier.Seed, ok bool) {
	if st == nil || len(st.Ports) == 0 || len(fams) != 1 || bindLink {
		return nil, false
	}
	seeds = make([]proxier.Seed, 0, len(st.Ports))
	for i := range st.Ports {
		p := &st.Ports[i]
		if !inRange(p.ProxyPort) || (p.ExternalProxyPort != 0 && !inRange(p.ExternalProxyPort)) {
			return nil, false
		}
		seeds = append(seeds, proxier.Seed{Name: p.Name, Protocol: p.Protocol, ProxyPort: p.ProxyPort,
			ExternalProxyPort: p.ExternalProxyPort, Families: fams})
	}
	// The order of the rules read back: by name.
	slices.SortFunc(seeds, func(a, b proxier.Seed) int {
		return cmp.Or(strings.Compare(a.Name.Namespace, b.Name.Namespace), strings.Compare(a.Name.Name, b.Name.Name), strings.Compare(a.Name.Port, b.Name.Port))
	})
	return seeds, true
}

// proxyPortRange reports whether a port is one the proxy allocates proxy sockets from: the
// --proxy-port-range, or the kernel's ephemeral range (ip_local_port_range) when it chooses.
func proxyPortRange(r proxier.PortRange) func(uint16) bool {
	lo, hi := r.Base, r.Base+r.Size-1
	if r.IsKernelChosen() {
		lo, hi = 32768, 60999 // the kernel's default, if the file cannot be read
		if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
			if f := strings.Fields(string(b)); len(f) == 2 {
				a, errA := strconv.Atoi(f[0])
				z, errZ := strconv.Atoi(f[1])
				if errA == nil && errZ == nil {
					lo, hi = a, z
				}
			}
		}
	}
	return func(p uint16) bool { return int(p) >= lo && int(p) <= hi }
}
