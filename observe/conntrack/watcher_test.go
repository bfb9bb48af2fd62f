package conntrack

import (
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	ct "github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Address plan of the unit tests (no packet is sent): client 10.100.0.2, the service
// 10.96.0.10:80/TCP and :53/UDP, its endpoint 10.244.1.10:8080 (:5353 UDP); 10.96.0.11 is no
// kernel-path service.

// events is a Recorder that keeps a copy of every event.
type events struct {
	mu  sync.Mutex
	evs []flow.Event
}

func (r *events) Record(e *flow.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, *e)
}

func (r *events) get() []flow.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]flow.Event(nil), r.evs...)
}

// ports maps service addresses to their Recorder.
type ports map[portKey]flow.Recorder

type portKey struct {
	proto flow.Protocol
	dst   netip.AddrPort
}

func (p ports) Lookup(proto flow.Protocol, dst netip.AddrPort) flow.Recorder {
	return p[portKey{proto, dst}]
}

// entry builds a conntrack entry from client to svc, DNATed to ep.
func entry(id uint32, proto uint8, client, svc, ep string) *ct.Flow {
	c, s, e := netip.MustParseAddrPort(client), netip.MustParseAddrPort(svc), netip.MustParseAddrPort(ep)
	f := ct.NewFlow(proto, 0, c.Addr(), s.Addr(), c.Port(), s.Port(), 0, 0)
	f.ID = id
	f.TupleReply.IP.SourceAddress, f.TupleReply.Proto.SourcePort = e.Addr(), e.Port()
	return &f
}

// clock is a manual clock.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func testReader(p PortLookup, c *clock, maxPending int) *reader {
	w := NewWatcher(p, Options{Now: c.now, MaxPending: maxPending})
	return newReader(w, nil)
}

var (
	client = netip.MustParseAddrPort("10.100.0.2:40000")
	svcTCP = netip.MustParseAddrPort("10.96.0.10:80")
	epTCP  = netip.MustParseAddrPort("10.244.1.10:8080")
)

// TestStartAndEndOfAMatchingFlow: a NEW becomes a Start and the DESTROY an End with the same ID,
// the client, the service address, the DNAT target, the counters and the kernel's times.
func TestStartAndEndOfAMatchingFlow(t *testing.T) {
	rec := &events{}
	c := &clock{t: time.Unix(1000, 0)}
	r := testReader(ports{{flow.TCP, svcTCP}: rec}, c, 0)
	t0, t1 := time.Unix(900, 0), time.Unix(905, 500)

	f := entry(7, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String())
	f.Timestamp.Start = t0
	r.start(f)
	d := *f
	d.Timestamp.Stop = t1
	d.CountersOrig = ct.Counter{Packets: 6, Bytes: 400}
	d.CountersReply = ct.Counter{Packets: 5, Bytes: 9000, Direction: true}
	d.ProtoInfo.TCP = &ct.ProtoInfoTCP{State: tcpTimeWait, ReplyFlags: tcpCloseInit}
	r.end(&d)

	info := flow.Info{Client: client, Endpoint: epTCP, Start: t0}
	end := info
	end.Duration, end.BytesToEndpoint, end.BytesToClient, end.End = t1.Sub(t0), 400, 9000, flow.EndpointClosed
	want := []flow.Event{
		{Phase: flow.PhaseStart, ID: IDBit | 7, Time: t0, Local: svcTCP, Info: info},
		{Phase: flow.PhaseEnd, ID: IDBit | 7, Time: t1, Local: svcTCP, Info: end},
	}
	if d := cmp.Diff(want, rec.get(), cmpopts.EquateComparable(netip.AddrPort{})); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}
}

// TestDurationFromTheNewSeenWithoutKernelTimestamps: with nf_conntrack_timestamp off the entry
// has no times, so the Start is when the NEW was read and the Duration runs from it.
func TestDurationFromTheNewSeenWithoutKernelTimestamps(t *testing.T) {
	rec := &events{}
	c := &clock{t: time.Unix(1000, 0)}
	r := testReader(ports{{flow.UDP, netip.MustParseAddrPort("10.96.0.10:53")}: rec}, c, 0)
	f := entry(9, unix.IPPROTO_UDP, client.String(), "10.96.0.10:53", "10.244.1.10:5353")
	r.start(f)
	c.t = c.t.Add(3 * time.Second)
	d := *f
	d.CountersOrig, d.CountersReply = ct.Counter{Packets: 2, Bytes: 60}, ct.Counter{Packets: 1, Bytes: 40}
	r.end(&d)
	evs := rec.get()
	if len(evs) != 2 {
		t.Fatalf("got %d events, want Start and End: %+v", len(evs), evs)
	}
	e := evs[1]
	got := []any{e.Time, e.Start, e.Duration, e.PacketsToEndpoint, e.PacketsToClient, e.End}
	want := []any{time.Unix(1003, 0), time.Unix(1000, 0), 3 * time.Second, uint64(2), uint64(1), flow.IdleTimeout}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("End's time, start, duration, packets, reason (-want +got):\n%s", d)
	}
}

// TestNonMatchingFlowsAreNotReported: entries to an address no kernel-path port has, and of
// other protocols, report nothing.
func TestNonMatchingFlowsAreNotReported(t *testing.T) {
	rec := &events{}
	r := testReader(ports{{flow.TCP, svcTCP}: rec}, &clock{t: time.Unix(1, 0)}, 0)
	for _, f := range []*ct.Flow{
		entry(1, unix.IPPROTO_TCP, client.String(), "10.96.0.11:80", epTCP.String()),
		entry(2, unix.IPPROTO_UDP, client.String(), svcTCP.String(), epTCP.String()), // the port is TCP
		entry(3, unix.IPPROTO_SCTP, client.String(), svcTCP.String(), epTCP.String()),
	} {
		r.start(f)
		r.end(f)
	}
	if evs := rec.get(); len(evs) != 0 {
		t.Errorf("got events for flows of no port: %+v", evs)
	}
	if n := r.pending.len(); n != 0 {
		t.Errorf("%d flows of no port remembered", n)
	}
}

// TestEndGoesWhereTheStartWent: a port removed between NEW and DESTROY still gets its flow's
// End; a DESTROY whose NEW was not seen goes to the port found then, without a Duration.
func TestEndGoesWhereTheStartWent(t *testing.T) {
	rec := &events{}
	p := ports{{flow.TCP, svcTCP}: rec}
	r := testReader(p, &clock{t: time.Unix(1, 0)}, 0)
	f := entry(1, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String())
	r.start(f)
	delete(p, portKey{flow.TCP, svcTCP})
	r.end(f)
	p[portKey{flow.TCP, svcTCP}] = rec
	r.end(entry(2, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String()))

	var got []string
	for _, e := range rec.get() {
		got = append(got, e.Phase.String()+" "+time.Duration(e.ID&^IDBit).String()+" "+e.Duration.String())
	}
	want := []string{"start 1ns 0s", "end 1ns 0s", "end 2ns 0s"}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("phase, id, duration (-want +got):\n%s", d)
	}
}

// TestPendingIsBoundedAndDropsTheOldest: at MaxPending remembered flows the oldest is forgotten
// and counted; flows that ended do not count against the bound.
func TestPendingIsBoundedAndDropsTheOldest(t *testing.T) {
	r := testReader(ports{{flow.TCP, svcTCP}: &events{}}, &clock{t: time.Unix(1, 0)}, 100)
	flows := make([]*ct.Flow, 250)
	for i := range flows {
		flows[i] = entry(uint32(i+1), unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String())
	}
	for i := range 150 { // 150 short flows: none is evicted
		r.start(flows[i])
		r.end(flows[i])
	}
	if st := r.w.Stats(); st.Evicted != 0 || r.pending.len() != 0 {
		t.Fatalf("after flows that ended: evicted %d, remembered %d; want 0, 0", st.Evicted, r.pending.len())
	}
	for i := 150; i < 250; i++ {
		r.start(flows[i])
	}
	r.start(entry(1000, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String()))
	if st := r.w.Stats(); st.Evicted != 1 || r.pending.len() != 100 || len(r.pending.ring) > 100 {
		t.Fatalf("evicted %d, remembered %d, ring %d; want 1, 100, <= 100", st.Evicted, r.pending.len(), len(r.pending.ring))
	}
	if _, ok := r.pending.take(key{id: 151, proto: flow.TCP, client: client, local: svcTCP}); ok {
		t.Error("the oldest flow is still remembered")
	}
	if _, ok := r.pending.take(key{id: 152, proto: flow.TCP, client: client, local: svcTCP}); !ok {
		t.Error("the second oldest flow was forgotten")
	}
}

// TestEndReasons maps conntrack's state at DESTROY to why the flow ended.
func TestEndReasons(t *testing.T) {
	assured := ct.Status(ct.StatusAssured)
	for _, c := range []struct {
		name    string
		proto   flow.Protocol
		tcp     *ct.ProtoInfoTCP
		status  ct.Status
		timeout uint32
		want    flow.EndReason
		err     error
	}{
		{"client closed first", flow.TCP, &ct.ProtoInfoTCP{State: tcpTimeWait, OriginalFlags: tcpCloseInit}, assured, 0, flow.ClientClosed, nil},
		{"endpoint closed first", flow.TCP, &ct.ProtoInfoTCP{State: tcpTimeWait, ReplyFlags: tcpCloseInit}, assured, 0, flow.EndpointClosed, nil},
		{"closed, side unknown", flow.TCP, &ct.ProtoInfoTCP{State: tcpTimeWait}, assured, 0, flow.Unknown, nil},
		{"reset", flow.TCP, &ct.ProtoInfoTCP{State: tcpClose}, assured, 0, flow.Unknown, ErrReset},
		{"refused", flow.TCP, &ct.ProtoInfoTCP{State: tcpClose}, 0, 0, flow.DialFailed, nil},
		{"never answered", flow.TCP, &ct.ProtoInfoTCP{State: tcpSynSent}, 0, 0, flow.DialFailed, nil},
		{"idle", flow.TCP, &ct.ProtoInfoTCP{State: tcpEstablished}, assured, 0, flow.IdleTimeout, nil},
		{"deleted while established", flow.TCP, &ct.ProtoInfoTCP{State: tcpEstablished}, assured, 300, flow.Unknown, nil},
		{"no TCP state", flow.TCP, nil, assured, 0, flow.Unknown, nil},
		{"UDP expired", flow.UDP, nil, assured, 0, flow.IdleTimeout, nil},
		{"UDP deleted", flow.UDP, nil, assured, 20, flow.Unknown, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := &ct.Flow{Status: c.status, Timeout: c.timeout}
			f.ProtoInfo.TCP = c.tcp
			got, err := endReason(c.proto, f)
			if got != c.want || err != c.err {
				t.Errorf("endReason = %v, %v; want %v, %v", got, err, c.want, c.err)
			}
		})
	}
}

// TestIDsAreTheKernelPathsOwn: a flow ID carries the conntrack id under IDBit; an entry without
// one gets a number of the watcher's, the same in its Start and End.
func TestIDsAreTheKernelPathsOwn(t *testing.T) {
	rec := &events{}
	r := testReader(ports{{flow.TCP, svcTCP}: rec}, &clock{t: time.Unix(1, 0)}, 0)
	f := entry(0, unix.IPPROTO_TCP, client.String(), svcTCP.String(), epTCP.String())
	r.start(f)
	r.end(f)
	evs := rec.get()
	if len(evs) != 2 || evs[0].ID != evs[1].ID || evs[0].ID != IDBit|ownIDBit|1 {
		t.Errorf("IDs of an entry without a conntrack id: %+v; want Start and End with %#x", evs, uint64(IDBit|ownIDBit|1))
	}
}
