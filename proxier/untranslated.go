package proxier

// untranslated.go: a UDP client that sends to a service port before any rule steers it (the
// port is new and its first sync has not run yet, or the node port had neither its REJECT nor
// its REDIRECT) gets a conntrack entry without NAT: the datagram is delivered to the node
// itself, where nothing listens on the node port, and the entry is confirmed. The nat table is
// consulted only for a flow's first packet, so every later datagram of that flow (same source
// port: the upstream conntrack e2e client sends from a fixed port in a tight loop, each ICMP
// port unreachable ending its nc at once) follows the entry past the REDIRECT that the port
// gets later, and the entry never times out while the client keeps sending. The filter-table
// REJECT does not create such entries (it drops the datagram before conntrack confirms it),
// so it is the window before a port's first rules that does.
//
// TCP has the same window. A client's SYN to a cluster IP before its first rules is routed on
// untranslated (on a node with a route for the service range) and its entry waits in SYN_SENT
// for 120 s; a later connection from the same source port (a client's ephemeral ports come round
// in a few minutes at 100 connections a second) is taken for that flow, is neither translated
// nor answered, and fails with "no route to host" when the node's neighbour lookup of the
// cluster IP gives up. bench/scale's restarts found it: a cold start's probes before the first
// sync left such entries, and clients failed minutes later.
//
// kube-proxy deletes a UDP service's entries when its endpoints go from none to some. Here the
// proxier deletes, after a sync that made a TCP or UDP port steer a class of its traffic
// (cluster or external) that it did not steer before, the untranslated entries to that port's
// destinations: only the ones that cannot be right (a translated entry belongs to a live flow
// through the proxy socket or, on the kernel path, to an endpoint), all ports of one sync in
// one walk of the table per family.

import (
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/conntrack"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// steerBits says which classes of a port's traffic its applied rules steer to a socket or an
// endpoint.
type steerBits uint8

const (
	steersInternal steerBits = 1 << iota
	steersExternal
)

// steered is what a port's rules steered as of the last sync that worked; gen is the sync that
// last saw the port, so ports gone since can be dropped.
type steered struct {
	bits steerBits
	gen  uint64
}

// steersOf reports what a spec's rules steer.
func steersOf(s *portal.Spec) steerBits {
	var b steerBits
	if k := s.Kernel; k != nil {
		if len(k.Cluster) > 0 || len(k.Local) > 0 {
			b = steersInternal | steersExternal
		}
		return b
	}
	if !s.RejectInternal {
		b |= steersInternal
	}
	if !s.RejectExternal {
		b |= steersExternal
	}
	return b
}

// clearUntranslated is called after a sync that worked, with its specs: it deletes the
// untranslated conntrack entries of the TCP and UDP ports that steer a class of traffic they did
// not steer at the last sync (new ports included), in one ClearUntranslated. Per sync it costs a
// map lookup per port, and a walk of the conntrack table only when some port began to steer.
func (d *dataPaths) clearUntranslated(specs []portal.Spec) {
	if d.deps.Conntrack == nil {
		return // bind mode: no NAT, every entry is untranslated and right
	}
	if d.steered == nil {
		d.steered = make(map[service.ServicePortName]*steered)
	}
	d.steerGen++
	gen := d.steerGen
	var flows []conntrack.Flows
	seen := 0
	for i := range specs {
		s := &specs[i]
		if s.Protocol != service.UDP && s.Protocol != service.TCP {
			continue // SCTP: no portal
		}
		seen++
		bits := steersOf(s)
		st := d.steered[s.Name] // one map lookup per port
		if st == nil {
			st = &steered{}
			d.steered[s.Name] = st
		}
		if bits&^st.bits != 0 {
			flows = append(flows, conntrack.FlowsOfSpec(s))
		}
		st.bits, st.gen = bits, gen
	}
	if len(d.steered) > seen {
		for name, st := range d.steered {
			if st.gen != gen {
				delete(d.steered, name)
			}
		}
	}
	if len(flows) == 0 {
		return
	}
	if err := d.deps.Conntrack.ClearUntranslated(d.runCtx, flows); err != nil {
		d.log.WithField("count", len(flows)).WithError(err).Warn("Clearing the untranslated conntrack entries of service ports that began to steer traffic")
	}
}
