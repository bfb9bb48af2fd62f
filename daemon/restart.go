package daemon

// restart.go: what a restarted daemon does before anything else so that a restart drops as little
// as possible. After SIGKILL or an OOM kill the portal rules of the old process are still in force
// and point at its proxy ports; the new process reopens those ports (proxier.Reopen) before it has
// read a single Service, so traffic flows again within milliseconds of the start instead of after
// the first full sync.

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
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
