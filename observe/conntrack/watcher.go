// Package conntrack reports the flows of kernel-path service ports (portal/kernel: KUBE-SVC and
// KUBE-SEP chains that DNAT straight to the endpoints, no proxy socket in between) to the live
// flow stream. No socket of ours sees those flows, so the Watcher follows the kernel's
// conntrack events: a NEW event becomes a Start, a DESTROY an End with the entry's counters. It
// only reads events; deleting entries is portal/conntrack's job.
package conntrack

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/sirupsen/logrus"
	ct "github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// PortLookup finds the kernel-path service port a flow reached. The proxier implements it.
type PortLookup interface {
	// Lookup returns the Recorder of the kernel-path port whose address dst is (a cluster IP,
	// external IP or load-balancer IP at the port, or a node IP at the node port), or nil when
	// dst is not one: that flow is not reported. It is called for every NEW and DESTROY of every
	// TCP and UDP entry on the node, on the watcher's goroutine, so it must be quick (a map
	// lookup) and must not block.
	Lookup(proto flow.Protocol, dst netip.AddrPort) flow.Recorder
}

// Options tune a Watcher. The zero value is ready.
type Options struct {
	// Do, when set, runs the opening of the netlink socket (and the sysctl check), e.g. on a
	// thread switched into another network namespace (tests pass netns.NS.Do): the socket
	// reports the events of the namespace it was opened in. Nil opens it in the caller's.
	Do func(func() error) error
	// Logger gets one line when the counters or timestamps are off, one per burst of overruns,
	// and one per undecodable message. Nil: logrus's standard logger.
	Logger logrus.FieldLogger
	// MaxPending bounds how many started flows are remembered until their DESTROY (for the
	// Duration when the kernel does not stamp entries, and to send End where Start went).
	// Default 65536; when full, the oldest is forgotten and counted (Stats.Evicted).
	MaxPending int
	// ReadBuffer is the socket's receive buffer in bytes, capped by net.core.rmem_max. Default
	// 4 MiB: events come in bursts (a connection storm), and a buffer that fills loses them.
	ReadBuffer int
	// Now is the clock for events the kernel does not stamp and for the probes. Nil: time.Now.
	Now func() time.Time
	// ProbeInterval is how long after its NEW a started entry is first asked for, and how
	// often an established TCP entry is asked again (probe.go: so that an entry's End comes
	// when it expires, not up to a minute later at conntrack's next garbage collection).
	// Default 5 s; negative turns probing off.
	ProbeInterval time.Duration
	// MaxProbeRate bounds the probes (one netlink GET each) per second; with more entries
	// than it covers at ProbeInterval, established entries are asked less often. Default 500.
	MaxProbeRate int
}

// Stats are a Watcher's counters since Run began.
type Stats struct {
	// Events counts the conntrack events read; Started and Ended those reported (a port matched).
	Events, Started, Ended uint64
	// Overruns counts the times the socket's buffer overflowed (ENOBUFS): the kernel dropped
	// events, so some flows lack their Start or End.
	Overruns uint64
	// Evicted counts started flows forgotten because MaxPending were remembered; their End still
	// comes, with the kernel's times if it stamps them.
	Evicted uint64
	// Undecodable counts messages that did not decode as conntrack events (skipped).
	Undecodable uint64
	// Probes counts the GETs of started entries (probe.go).
	Probes uint64
}

// Watcher turns conntrack events of kernel-path ports into flow events.
type Watcher struct {
	ports PortLookup
	opts  Options
	ready chan struct{}
	once  sync.Once

	events, started, ended, overruns, evicted, undecodable, probes atomic.Uint64
}

// overrunQuiet is how long without an overrun ends a burst: an overrun after it is logged.
const overrunQuiet = 10 * time.Second

// NewWatcher returns a Watcher of ports. It opens nothing: Run does.
func NewWatcher(ports PortLookup, opts Options) *Watcher {
	if opts.MaxPending <= 0 {
		opts.MaxPending = 65536
	}
	if opts.ReadBuffer <= 0 {
		opts.ReadBuffer = 4 << 20
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = logrus.StandardLogger()
	}
	if opts.ProbeInterval == 0 {
		opts.ProbeInterval = 5 * time.Second
	}
	if opts.MaxProbeRate <= 0 {
		opts.MaxProbeRate = 500
	}
	return &Watcher{ports: ports, opts: opts, ready: make(chan struct{})}
}

// Ready is closed once Run has subscribed: flows that start after it are seen.
func (w *Watcher) Ready() <-chan struct{} { return w.ready }

// Stats returns the counters.
func (w *Watcher) Stats() Stats {
	return Stats{Events: w.events.Load(), Started: w.started.Load(), Ended: w.ended.Load(),
		Overruns: w.overruns.Load(), Evicted: w.evicted.Load(), Undecodable: w.undecodable.Load(),
		Probes: w.probes.Load()}
}

// Run subscribes to the conntrack NEW and DESTROY events (call it once) and reports those of matching ports
// until ctx ends; then it closes the socket and returns nil. It reads on the calling goroutine
// and starts none that outlives it. An overrun is counted and logged, and reading goes on; any
// other read error ends Run with it.
//
// It reads the socket itself rather than through ct.Conn.Listen, whose workers stop for good
// at the first error, ENOBUFS included: a watcher that goes deaf after one burst is worse than
// one that loses the burst.
func (w *Watcher) Run(ctx context.Context) error {
	c, getter, err := w.open()
	if err != nil {
		return err
	}
	if getter != nil {
		defer getter.Close()
	}
	// Closing the socket is what wakes a Receive blocked on a quiet table. Run waits for the
	// close it started at ctx's end, so no goroutine of its outlives it.
	closed := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		c.Close()
		close(closed)
	})
	defer func() {
		if stop() {
			c.Close()
		} else {
			<-closed
		}
	}()
	r := newReader(w, getter)
	w.once.Do(func() { close(w.ready) })
	var deadline time.Time // the socket's read deadline now
	for {
		// A read waits no longer than the next probe is due.
		if wake, _ := r.wake(); !wake.Equal(deadline) {
			if err := c.SetReadDeadline(wake); err != nil {
				return fmt.Errorf("conntrack watcher: set the read deadline: %w", err)
			}
			deadline = wake
		}
		msgs, err := c.Receive()
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case err == nil:
			for _, m := range msgs {
				r.message(m)
			}
		case errors.Is(err, os.ErrDeadlineExceeded):
		case errors.Is(err, unix.ENOBUFS):
			r.overrun()
		default:
			return fmt.Errorf("conntrack watcher: read events: %w", err)
		}
		r.probe()
	}
}

// open opens the socket, in the namespace Do runs in, subscribed to NEW and DESTROY, and the
// probes' socket (nil when probing is off or the socket cannot be had: said once), and says
// once if the kernel counts no bytes or stamps no times.
func (w *Watcher) open() (*netfilter.Conn, *ct.Conn, error) {
	var c *netfilter.Conn
	var getter *ct.Conn
	var getErr error
	var sysctls []string
	do := w.opts.Do
	if do == nil {
		do = func(fn func() error) error { return fn() }
	}
	err := do(func() error {
		var err error
		if c, err = netfilter.Dial(nil); err != nil {
			return err
		}
		if err := c.JoinGroups([]netfilter.NetlinkGroup{netfilter.GroupCTNew, netfilter.GroupCTDestroy}); err != nil {
			c.Close()
			return err
		}
		sysctls = offSysctls()
		if w.opts.ProbeInterval > 0 {
			getter, getErr = ct.Dial(nil)
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("conntrack watcher: subscribe to conntrack NEW and DESTROY events: %w", err)
	}
	if getErr != nil {
		w.opts.Logger.WithError(getErr).Warn(noProbes)
	}
	if err := c.SetReadBuffer(w.opts.ReadBuffer); err != nil {
		w.opts.Logger.WithError(err).Warn("conntrack watcher: could not set the socket's receive buffer; a burst of events may overrun it")
	}
	if len(sysctls) > 0 {
		w.opts.Logger.WithField("sysctls", strings.Join(sysctls, ",")).Warn(
			"conntrack watcher: kernel-path flows will lack byte and packet counts (nf_conntrack_acct=0) or kernel start times (nf_conntrack_timestamp=0; durations then count from the NEW event seen); set the sysctls to 1 in the node's network namespace to have them")
	}
	return c, getter, nil
}

// noProbes is said once when entries cannot be looked up.
const noProbes = "conntrack watcher: cannot look conntrack entries up; a kernel-path flow's end comes when the kernel's garbage collector removes its expired entry, up to a minute late"

// offSysctls lists the conntrack accounting sysctls that are off in the calling thread's network
// namespace (/proc/sys/net follows the opener's namespace). One that cannot be read (no
// nf_conntrack loaded yet) is not reported.
func offSysctls() []string {
	var off []string
	for _, name := range []string{"nf_conntrack_acct", "nf_conntrack_timestamp"} {
		b, err := os.ReadFile("/proc/sys/net/netfilter/" + name)
		if err == nil && strings.TrimSpace(string(b)) == "0" {
			off = append(off, "net.netfilter."+name)
		}
	}
	return off
}

// reader is Run's state: only Run's goroutine touches it.
type reader struct {
	w       *Watcher
	pending *pending
	ownID   uint64

	// get asks the kernel for one entry; nil: probing is off (probe.go).
	get    entryGetter
	probes *probeSchedule
	tokens float64   // GETs allowed now, refilled at MaxProbeRate up to one second's worth
	filled time.Time // when tokens was last refilled

	lastOverrun   time.Time
	overrunsTotal uint64 // at the last overrun log line
}

// overrun counts an ENOBUFS and logs the first of a burst with how many came since the last line.
func (r *reader) overrun() {
	n := r.w.overruns.Add(1)
	now := r.w.opts.Now()
	if r.lastOverrun.IsZero() || now.Sub(r.lastOverrun) > overrunQuiet {
		r.w.opts.Logger.WithFields(logrus.Fields{"overruns": n, "since_last_log": n - r.overrunsTotal}).Warn(
			"conntrack watcher: the socket's receive buffer overflowed; the kernel dropped events, so some kernel-path flows lack their start or end")
		r.overrunsTotal = n
	}
	r.lastOverrun = now
}

func (r *reader) message(m netlink.Message) {
	var ev ct.Event
	if err := ev.Unmarshal(m); err != nil {
		if r.w.undecodable.Add(1) == 1 {
			r.w.opts.Logger.WithError(err).Warn("conntrack watcher: skipping a message that is not a conntrack event (logged once)")
		}
		return
	}
	r.w.events.Add(1)
	if ev.Flow == nil {
		return
	}
	switch ev.Type {
	case ct.EventNew:
		r.start(ev.Flow)
	case ct.EventDestroy:
		r.end(ev.Flow)
	}
}

// start reports the NEW of a matching port's flow.
func (r *reader) start(f *ct.Flow) {
	proto, client, local, endpoint, ok := tuples(f)
	if !ok {
		return
	}
	rec := r.w.ports.Lookup(proto, local)
	if rec == nil {
		return
	}
	start := f.Timestamp.Start
	if start.IsZero() {
		start = r.w.opts.Now()
	}
	id := r.id(f.ID)
	k := key{id: f.ID, proto: proto, client: client, local: local}
	r.pending.add(k, started{id: id, start: start, rec: rec})
	r.w.evicted.Store(r.pending.evicted)
	if r.get != nil {
		r.probes.set(k, r.w.opts.Now().Add(r.w.opts.ProbeInterval))
	}
	e := flow.Event{Phase: flow.PhaseStart, ID: id, Time: start, Local: local,
		Info: flow.Info{Client: client, Endpoint: endpoint, Start: start}}
	r.w.started.Add(1)
	rec.Record(&e)
}

// end reports the DESTROY of a matching port's flow: to the Recorder its Start went to, or, if
// that was not seen (before Run, lost, evicted), to the port's now.
func (r *reader) end(f *ct.Flow) {
	proto, client, local, endpoint, ok := tuples(f)
	if !ok {
		return
	}
	k := key{id: f.ID, proto: proto, client: client, local: local}
	s, seen := r.pending.take(k)
	if r.get != nil {
		r.probes.drop(k)
	}
	if !seen {
		if s.rec = r.w.ports.Lookup(proto, local); s.rec == nil {
			return
		}
		s.id = r.id(f.ID)
	}
	// The kernel stamps the start and stop in DESTROY only (nf_conntrack_timestamp), so the
	// Start said at NEW, from our clock, stays the flow's start; the Duration is the kernel's.
	e := flow.Event{Phase: flow.PhaseEnd, ID: s.id, Time: f.Timestamp.Stop, Local: local,
		Info: flow.Info{Client: client, Endpoint: endpoint, Start: s.start}}
	if e.Time.IsZero() {
		e.Time = r.w.opts.Now()
	}
	if e.Start.IsZero() {
		e.Start = f.Timestamp.Start
	}
	// A flow shorter than the time the NEW took to reach us (a refused SYN) stops, by the
	// kernel's stamp, before the Start we said: its End is not put before its Start.
	if e.Time.Before(e.Start) {
		e.Time = e.Start
	}
	switch {
	case !f.Timestamp.Start.IsZero() && !f.Timestamp.Stop.IsZero():
		e.Duration = f.Timestamp.Stop.Sub(f.Timestamp.Start)
	case !e.Start.IsZero(): // else the NEW was not seen either: no Duration
		e.Duration = e.Time.Sub(e.Start)
	}
	e.BytesToEndpoint, e.BytesToClient = f.CountersOrig.Bytes, f.CountersReply.Bytes
	if proto == flow.UDP { // flow.Info counts datagrams for UDP only
		e.PacketsToEndpoint, e.PacketsToClient = f.CountersOrig.Packets, f.CountersReply.Packets
	}
	e.End, e.Err = endReason(proto, f)
	r.w.ended.Add(1)
	s.rec.Record(&e)
}

func newReader(w *Watcher, get entryGetter) *reader {
	r := &reader{w: w, pending: newPending(w.opts.MaxPending)}
	if get != nil && w.opts.ProbeInterval > 0 {
		r.get, r.probes = get, newProbeSchedule()
		r.tokens, r.filled = float64(w.opts.MaxProbeRate), w.opts.Now()
	}
	return r
}

// wake is when the next probe may go (the zero time, ok false, when none is scheduled): when it
// is due, or later if the rate's budget is spent.
func (r *reader) wake() (time.Time, bool) {
	if r.get == nil {
		return time.Time{}, false
	}
	due, ok := r.probes.next()
	if !ok {
		return time.Time{}, false
	}
	if r.tokens < 1 {
		refill := r.filled.Add(time.Duration((1 - r.tokens) / float64(r.w.opts.MaxProbeRate) * float64(time.Second)))
		if refill.After(due) {
			due = refill
		}
	}
	return due, true
}

// probe asks the kernel for the started entries whose probe is due, as many as the rate allows,
// and schedules each found live entry's next one (probe.go). A GET of an expired entry removes
// it: its DESTROY comes next on the event socket. An error other than "no such entry" turns
// probing off, said once.
func (r *reader) probe() {
	if r.get == nil {
		return
	}
	now := r.w.opts.Now()
	rate := float64(r.w.opts.MaxProbeRate)
	r.tokens = min(rate, r.tokens+now.Sub(r.filled).Seconds()*rate)
	r.filled = now
	// Established entries are asked again every ProbeInterval, or less often when more are
	// started than the rate covers in that time.
	recheck := max(r.w.opts.ProbeInterval, time.Duration(float64(r.probes.len())/rate*float64(time.Second)))
	for r.tokens >= 1 {
		k, ok := r.probes.pop(now)
		if !ok {
			return
		}
		if _, live := r.pending.m[k]; !live { // evicted: its End comes without a Start's Recorder
			continue
		}
		r.tokens--
		r.w.probes.Add(1)
		f, err := r.get.Get(lookupFlow(k))
		switch {
		case errNoEntry(err):
			// Gone: removed by this GET if it had expired, or earlier; its DESTROY is on its way.
		case err != nil:
			r.w.opts.Logger.WithError(err).Warn(noProbes)
			r.get, r.probes = nil, nil
			return
		case k.id != 0 && f.ID != k.id:
			// Another entry on the same tuple: the one started is gone.
		default:
			r.probes.set(k, afterProbe(&f, now, recheck))
		}
	}
}

// id is the flow ID of an entry (IDBit).
func (r *reader) id(ctID uint32) uint64 {
	if ctID != 0 {
		return IDBit | uint64(ctID)
	}
	r.ownID++
	return IDBit | ownIDBit | r.ownID
}
