// Package pcap writes the flows and payload of an observe stream as a pcapng file that Wireshark
// and tshark read: the proxy sees bytes on sockets, not packets, so each flow's two legs (the
// client to the service address, the proxy's source socket to the pod) are synthesized as IP
// packets with TCP or UDP headers and correct checksums, numbered so that "Follow TCP stream"
// reassembles exactly the bytes that moved.
package pcap

import (
	"bufio"
	"container/list"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/netip"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// Defaults of Options.
const (
	// DefaultPendingBytes bounds the payload kept for flows whose event has not come yet.
	DefaultPendingBytes = 1 << 20
	// DefaultMaxFlows bounds the live flows tracked: a flow whose End event was lost is forgotten,
	// least recently active first, once this many are live.
	DefaultMaxFlows = 65536
)

// pendingItemCost is what a payload waiting for its flow counts against PendingBytes beyond
// its data, so that empty pieces are bounded too.
const pendingItemCost = 64

// Options bound what a Writer writes and keeps. The zero value is usable.
type Options struct {
	// MaxBytes caps the file: once the next packet would pass it, no more packets are written
	// (flows are still followed, and Close still leaves a valid file). 0 means no cap. The
	// file's two header blocks are written whatever the cap.
	MaxBytes int64
	// MaxFlowBytes caps the payload kept per flow, both directions together, on top of the cap
	// the server applied. 0 means no cap of the Writer's own.
	MaxFlowBytes int64
	// PendingBytes bounds the payload kept for flows not yet seen (their payload arrived before
	// their event, or their event was lost); 0 means DefaultPendingBytes.
	PendingBytes int
	// MaxFlows bounds the live flows tracked; 0 means DefaultMaxFlows.
	MaxFlows int
}

// Stats count what a Writer wrote and what it could not.
type Stats struct {
	Packets int64 // packets written
	Bytes   int64 // the file's size, header blocks included
	Flows   int64 // flows seen
	// CapReached: MaxBytes stopped the writing; PacketsOverCap counts the packets left out.
	CapReached     bool
	PacketsOverCap int64
	// TruncatedFlows counts flows whose capture was cut (the server's cap or MaxFlowBytes).
	TruncatedFlows int64
	// UnmatchedPayloadBytes counts payload dropped because it could not be placed in its flow:
	// the flow's event never came (the PendingBytes bound was reached, or the Writer was closed
	// first), or the payload came after the flow's End.
	UnmatchedPayloadBytes int64
	// EvictedFlows counts live flows forgotten at the MaxFlows bound (their End was lost).
	EvictedFlows int64
	// Lost sums the counts of the stream's Lost items: events the server could not send.
	Lost int64
}

// Writer turns a stream's items into a pcapng file. Feed it every item in stream order with
// WriteItem and Close it at the end. A Writer is not safe for concurrent use.
type Writer struct {
	w    *bufio.Writer
	opts Options
	err  error // the first write error, returned from then on

	started, closed bool
	stats           Stats

	flows map[flowKey]*flowState
	lru   *list.List // of *flowState, most recently active first

	pending      map[flowKey][]*observe.Payload
	pendingBytes int

	// ended remembers the last flows that ended (a ring of endedFlows keys), so payload that
	// comes after its flow's End is dropped at once instead of waiting for a flow that will not
	// come again.
	ended     map[flowKey]bool
	endedRing []flowKey
	endedNext int
}

// endedFlows is how many ended flows a Writer remembers.
const endedFlows = 4096

// flowKey names a flow in a stream merged from several nodes: IDs are unique per process only.
type flowKey struct {
	node string
	id   uint64
}

// NewWriter returns a Writer that writes to w. It writes nothing until the first item (or
// Close); Close does not close w.
func NewWriter(w io.Writer, opts Options) *Writer {
	if opts.PendingBytes <= 0 {
		opts.PendingBytes = DefaultPendingBytes
	}
	if opts.MaxFlows <= 0 {
		opts.MaxFlows = DefaultMaxFlows
	}
	return &Writer{
		w: bufio.NewWriter(w), opts: opts,
		flows: map[flowKey]*flowState{}, lru: list.New(), pending: map[flowKey][]*observe.Payload{},
		ended: map[flowKey]bool{},
	}
}

// ErrClosed is WriteItem's error after Close.
var ErrClosed = errors.New("pcap: writer closed")

// WriteItem writes the packets an item stands for. A Payload item whose flow has not been seen
// waits (bounded by Options.PendingBytes) for its flow's event. It returns the first error
// writing to the file, from then on.
func (w *Writer) WriteItem(it *observe.Item) error {
	if w.closed {
		return ErrClosed
	}
	if w.err != nil {
		return w.err
	}
	w.start()
	switch {
	case it.Flow != nil:
		w.flow(it.Flow)
	case it.Payload != nil:
		w.payload(it.Payload)
	case it.Lost != nil:
		w.stats.Lost += int64(it.Lost.Count)
	}
	return w.err
}

// Close flushes the file. Flows still live stay open in it (no FIN is invented for them), and
// payload still waiting for its flow is dropped and counted. It does not close the underlying
// writer.
func (w *Writer) Close() error {
	if w.closed {
		return w.err
	}
	w.start()
	w.closed = true
	for k, ps := range w.pending {
		for _, p := range ps {
			w.stats.UnmatchedPayloadBytes += int64(len(p.Data))
		}
		delete(w.pending, k)
	}
	w.pendingBytes = 0
	clear(w.flows)
	w.lru.Init()
	if err := w.w.Flush(); err != nil && w.err == nil {
		w.err = fmt.Errorf("pcap: flush: %w", err)
	}
	return w.err
}

// Stats returns the counts so far.
func (w *Writer) Stats() Stats { return w.stats }

// start writes the section header and the interface once.
func (w *Writer) start() {
	if w.started {
		return
	}
	w.started = true
	w.put(sectionHeader())
	w.put(interfaceDescription())
}

// put writes a block.
func (w *Writer) put(b []byte) {
	if w.err != nil {
		return
	}
	if _, err := w.w.Write(b); err != nil {
		w.err = fmt.Errorf("pcap: write: %w", err)
		return
	}
	w.stats.Bytes += int64(len(b))
}

// emitter returns the emitFunc that writes packets at time t, within MaxBytes.
func (w *Writer) emitter(t time.Time) emitFunc {
	return func(pkt []byte, comment string) {
		b := enhancedPacket(t, pkt, comment)
		if w.stats.CapReached || (w.opts.MaxBytes > 0 && w.stats.Bytes+int64(len(b)) > w.opts.MaxBytes) {
			w.stats.CapReached = true
			w.stats.PacketsOverCap++
			return
		}
		w.put(b)
		if w.err == nil {
			w.stats.Packets++
		}
	}
}

// flowState is what the Writer keeps of a live flow.
type flowState struct {
	key                             flowKey
	udp                             bool
	name                            string // namespace/service:port, for comments
	client, service, source, endpnt netip.AddrPort
	endpointPod                     string
	start                           time.Time // when the flow began, as far as its events say
	clientTCP, podTCP               *tcpLeg
	clientUDP, podUDP               *udpLeg
	clientLegOpen, podLegOpen       bool
	captured                        int64
	truncated                       bool
	elem                            *list.Element
}

// udpLeg is one leg of a UDP flow: its addresses and IPv4 identifications.
type udpLeg struct {
	dir [2]endpoints
	id  [2]uint16
	// comment names the leg on its first datagram (a TCP leg names itself on its SYN).
	comment string
}

// flow handles a Flow event: the flow's legs open as soon as their addresses are known
// (the client's at its first event, the pod's once the proxy's source address is), the payload
// that waited for it is written, and End closes the TCP legs as the flow ended.
func (w *Writer) flow(f *observe.Flow) {
	k := flowKey{f.Node, f.ID}
	st := w.flows[k]
	if st == nil {
		st = &flowState{key: k, udp: f.Protocol == "UDP", start: f.Time}
		if f.Phase != "start" && f.DurationMicros > 0 {
			// Its Start was missed: the flow began Duration before this event.
			st.start = f.Time.Add(-time.Duration(f.DurationMicros) * time.Microsecond)
		}
		st.elem = w.lru.PushFront(st)
		w.flows[k] = st
		w.stats.Flows++
		w.evict()
	} else {
		w.lru.MoveToFront(st.elem)
	}
	st.update(f)
	waiting := w.pending[k]
	at := f.Time
	if len(waiting) > 0 && waiting[0].Time.Before(at) {
		at = waiting[0].Time
	}
	w.openLegs(st, f, at)
	if len(waiting) > 0 {
		delete(w.pending, k)
		for _, p := range waiting {
			w.pendingBytes -= len(p.Data) + pendingItemCost
			w.write(st, p)
		}
	}
	if f.Phase == "end" {
		w.end(st, f)
		w.lru.Remove(st.elem)
		delete(w.flows, k)
		w.remember(k)
	}
}

// remember notes that flow k ended, forgetting the oldest flow remembered.
func (w *Writer) remember(k flowKey) {
	if len(w.endedRing) < endedFlows {
		w.endedRing = append(w.endedRing, k)
	} else {
		delete(w.ended, w.endedRing[w.endedNext])
		w.endedRing[w.endedNext] = k
		w.endedNext = (w.endedNext + 1) % endedFlows
	}
	w.ended[k] = true
}

// update takes the names and addresses an event knows; later events keep what earlier ones said.
func (st *flowState) update(f *observe.Flow) {
	if st.name == "" && f.Service != "" {
		st.name = f.Namespace + "/" + f.Service
		if f.Port != "" {
			st.name += ":" + f.Port
		}
	}
	set := func(dst *netip.AddrPort, s string) {
		if a, err := netip.ParseAddrPort(s); err == nil {
			*dst = a
		}
	}
	set(&st.client, f.Client)
	set(&st.service, f.ServiceAddress)
	set(&st.source, f.Source)
	set(&st.endpnt, f.Endpoint)
	if f.EndpointPod != "" {
		st.endpointPod = f.EndpointPod
	}
}

// openLegs opens the legs whose addresses became known. The client's leg began with the flow;
// the pod's leg begins at this event (Dial for TCP) or at the first payload waiting, if earlier.
func (w *Writer) openLegs(st *flowState, f *observe.Flow, at time.Time) {
	if !st.clientLegOpen {
		if e, ok := legAddrs(st.client, st.service); ok {
			st.clientLegOpen = true
			t := st.start
			if at.Before(t) {
				t = at
			}
			c := fmt.Sprintf("%s client leg: client %s -> service %s", st.describe(), e.src, e.dst)
			if st.udp {
				st.clientUDP = &udpLeg{dir: [2]endpoints{e, e.reverse()}}
				st.clientUDP.comment = c
			} else {
				st.clientTCP = newTCPLeg(e, st.isn(0, sideA), st.isn(0, sideB))
				st.clientTCP.handshake(c, w.emitter(t))
			}
		}
	}
	if !st.podLegOpen {
		if e, ok := legAddrs(st.source, st.endpnt); ok {
			st.podLegOpen = true
			pod := ""
			if st.endpointPod != "" {
				pod = " " + st.endpointPod
			}
			c := fmt.Sprintf("%s pod leg: proxy %s -> endpoint%s %s", st.describe(), e.src, pod, e.dst)
			if st.udp {
				st.podUDP = &udpLeg{dir: [2]endpoints{e, e.reverse()}}
				st.podUDP.comment = c
			} else {
				st.podTCP = newTCPLeg(e, st.isn(1, sideA), st.isn(1, sideB))
				st.podTCP.handshake(c, w.emitter(at))
			}
		}
	}
}

func (st *flowState) describe() string {
	proto := "TCP"
	if st.udp {
		proto = "UDP"
	}
	s := fmt.Sprintf("flow %d", st.key.id)
	if st.key.node != "" {
		s += " node " + st.key.node
	}
	if st.name != "" {
		s += " " + st.name
	}
	return s + " " + proto + ","
}

// isn is the initial sequence number of one side of one leg (0 the client's, 1 the pod's): a
// hash of the flow, so one stream always gives the same file and the legs' numbers differ.
func (st *flowState) isn(leg int, s side) uint32 {
	h := fnv.New32a()
	fmt.Fprintf(h, "%s/%d/%d/%d", st.key.node, st.key.id, leg, s)
	return h.Sum32()
}

// evict forgets the least recently active flows past MaxFlows.
func (w *Writer) evict() {
	for w.lru.Len() > w.opts.MaxFlows {
		st := w.lru.Remove(w.lru.Back()).(*flowState)
		delete(w.flows, st.key)
		w.stats.EvictedFlows++
	}
}

// payload writes a piece of a known flow, or keeps it until its flow's event comes.
func (w *Writer) payload(p *observe.Payload) {
	k := flowKey{p.Node, p.ID}
	if st := w.flows[k]; st != nil {
		w.lru.MoveToFront(st.elem)
		w.write(st, p)
		return
	}
	cost := len(p.Data) + pendingItemCost
	if w.ended[k] || w.pendingBytes+cost > w.opts.PendingBytes {
		w.stats.UnmatchedPayloadBytes += int64(len(p.Data))
		return
	}
	// A copy: the caller may reuse the item once WriteItem returns.
	c := *p
	c.Data = append([]byte(nil), p.Data...)
	w.pending[k] = append(w.pending[k], &c)
	w.pendingBytes += cost
}

// write writes one piece of payload on each open leg of st: the client's side sends what goes
// to the endpoint, the server's side what goes to the client.
func (w *Writer) write(st *flowState, p *observe.Payload) {
	var s side
	switch p.Direction {
	case observe.DirToEndpoint:
		s = sideA
	case observe.DirToClient:
		s = sideB
	default:
		return // a direction this version does not know: nothing to place it on
	}
	if st.truncated {
		return
	}
	data := p.Data
	cut := p.Truncated
	if m := w.opts.MaxFlowBytes; m > 0 && st.captured+int64(len(data)) > m {
		data, cut = data[:m-st.captured], true
	}
	st.captured += int64(len(data))
	comment := ""
	if cut {
		st.truncated = true
		w.stats.TruncatedFlows++
		comment = fmt.Sprintf("capture truncated: flow %d reached its capture cap at %d bytes; later bytes were not captured", st.key.id, st.captured)
	}
	if len(data) == 0 && len(p.Data) > 0 {
		return // all of it past the cap (an empty datagram, though, is written)
	}
	emit := w.emitter(p.Time)
	if st.udp {
		for _, l := range []*udpLeg{st.clientUDP, st.podUDP} {
			if l != nil {
				l.send(s, data, comment, emit)
			}
		}
		return
	}
	for _, l := range []*tcpLeg{st.clientTCP, st.podTCP} {
		if l != nil {
			l.send(s, data, comment, emit)
		}
	}
}

// end closes the TCP legs of an ended flow as the proxy did: an orderly close (FIN both ways)
// started by the side that closed first, or a reset, and on the other leg what the proxy passed
// on. UDP has nothing to close.
func (w *Writer) end(st *flowState, f *observe.Flow) {
	if st.udp {
		return
	}
	origin, rst := endOf(f.EndReason, f.Verdict)
	comment := fmt.Sprintf("flow %d end: %s, verdict %s", st.key.id, f.EndReason, f.Verdict)
	if f.Error != "" {
		comment += ": " + f.Error
	}
	// Which side of each leg acts: the client's leg's A is the client, B the proxy (service
	// address); the pod's leg's A is the proxy (source), B the endpoint.
	clientSide, podSide := sideB, sideA // the proxy acts on both legs
	switch origin {
	case fromClient:
		clientSide, podSide = sideA, sideA
	case fromEndpoint:
		clientSide, podSide = sideB, sideB
	}
	type step struct {
		l *tcpLeg
		s side
	}
	steps := []step{{st.clientTCP, clientSide}, {st.podTCP, podSide}}
	if origin == fromEndpoint {
		steps[0], steps[1] = steps[1], steps[0] // the endpoint's close reached the proxy first
	}
	emit := w.emitter(f.Time)
	for _, s := range steps {
		if s.l == nil {
			continue
		}
		if rst {
			s.l.reset(s.s, comment, emit)
		} else {
			s.l.finish(s.s, comment, emit)
		}
		comment = ""
	}
}

// origin is who ended a flow.
type origin uint8

const (
	fromProxy origin = iota
	fromClient
	fromEndpoint
)

// endOf says who ended a TCP flow and whether with a reset, from its end reason (flow.EndReason's
// names) and verdict. The proxy resets both legs on shutdown, endpoint removal and drain
// deadline, and resets a client it cannot serve (no endpoint, a failed dial, a denied source, a
// hold timeout); it closes an idle connection.
func endOf(reason, verdict string) (origin, bool) {
	switch reason {
	case "client-closed":
		return fromClient, false
	case "endpoint-closed":
		return fromEndpoint, false
	case "client-reset":
		return fromClient, true
	case "endpoint-reset":
		return fromEndpoint, true
	case "idle-timeout":
		return fromProxy, false
	case "dial-failed", "no-endpoints", "endpoint-removed", "shutdown", "source-denied",
		"hold-timeout", "drain-timeout":
		return fromProxy, true
	}
	return fromProxy, verdict == "reset"
}

// send writes one datagram from s on the leg. A datagram too long for one IP packet (never
// expected: the proxy reads into 64 KiB buffers) is cut, and says so.
func (l *udpLeg) send(s side, data []byte, comment string, emit emitFunc) {
	if limit := maxIPPayload(l.dir[s].src.Addr().Is6()) - udpHeaderLen; len(data) > limit {
		comment = joinComments(fmt.Sprintf("datagram of %d bytes cut to %d to fit one packet", len(data), limit), comment)
		data = data[:limit]
	}
	comment, l.comment = joinComments(l.comment, comment), ""
	emit(buildUDP(l.dir[s], l.id[s], data), comment)
	l.id[s]++
}

// joinComments joins the non-empty comments with "; ".
func joinComments(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}
