package proxier

// Address plan: cluster IP 10.96.0.10 (web), endpoints 10.244.2.x; proxy ports 34001-34005 as a
// previous process's rules point at them. Sockets and portals are fakes; a socket's traffic is
// its counters, set by the test.

import (
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// trafficSocket is a fake socket whose counters the test moves.
type trafficSocket struct {
	*fakeSocket
	total, active atomic.Int64
}

func (s *trafficSocket) Stats() flow.Stats {
	return flow.Stats{Total: uint64(s.total.Load()), Active: s.active.Load()}
}
func (s *trafficSocket) Live() []flow.Info { return nil }

// TestReopenOrdersByActivity: the reopen opens the ports the snapshot says were used last first,
// the most recent first, then the others in the order of the rules read back (by name). The
// bench's probe port, last by name, was refused for the whole reopen (0.6-0.9 s beside a hog).
func TestReopenOrdersByActivity(t *testing.T) {
	e := newFakeEnv(t, nil)
	var seeds []Seed
	var ports []snapshot.Port
	for i, name := range []string{"a", "b", "c", "d", "e"} {
		s := seed("ns", name, "http", service.TCP, uint16(34001+i))
		seeds = append(seeds, s)
		sp := snapPort(s.Name, service.TCP, s.ProxyPort, "10.244.2.1:8080")
		switch name {
		case "d":
			sp.LastActive = e.clk.Now().Add(-10 * time.Second)
		case "e":
			sp.LastActive = e.clk.Now().Add(-2 * time.Second)
		case "b":
			sp.LastActive = e.clk.Now().Add(-time.Hour)
		}
		ports = append(ports, sp)
	}
	e.p.Reopen(seeds)
	e.p.Restore(&snapshot.State{Ports: ports})
	var got []string
	for _, s := range e.p.paths.restart.seeds {
		got = append(got, s.Name.Name)
	}
	if diff := cmp.Diff([]string{"e", "d", "b", "a", "c"}, got); diff != "" {
		t.Errorf("reopen order (-want +got):\n%s", diff)
	}
	// The order is the reopen's: one worker claims the seeds in it.
	forEachInNetns(len(e.p.paths.restart.seeds), 1, func(i int) {
		_, _ = e.p.paths.reopenSteered(e.p.paths.restart.seeds[i])
	})
	var opened []uint16
	for _, a := range e.listens {
		opened = append(opened, a.Port())
	}
	if diff := cmp.Diff([]uint16{34005, 34004, 34002, 34001, 34003}, opened); diff != "" {
		t.Errorf("ports opened (-want +got):\n%s", diff)
	}
}

func TestByActivityKeepsTheOthersInOrder(t *testing.T) {
	for _, tc := range []struct {
		name   string
		active map[string]int64
		want   string
	}{
		{"none", nil, "abcdef"},
		{"first", map[string]int64{"a": 1}, "abcdef"},
		{"last", map[string]int64{"f": 1}, "fabcde"},
		{"middle_two", map[string]int64{"c": 1, "e": 2}, "ecabdf"},
		{"all", map[string]int64{"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}, "fedcba"},
		{"ties_keep_order", map[string]int64{"d": 5, "b": 5}, "bdacef"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var seeds []Seed
			for _, n := range "abcdef" {
				seeds = append(seeds, seed("ns", string(n), "", service.TCP, 1))
			}
			byActivity(seeds, func(n service.ServicePortName) int64 { return tc.active[n.Name] })
			got := ""
			for _, s := range seeds {
				got += s.Name.Name
			}
			if got != tc.want {
				t.Errorf("order %s; want %s", got, tc.want)
			}
		})
	}
}

// TestNoteActivity: a port is stamped when its sockets accepted a connection (or created a
// session) since the last look, or have one open; the snapshot then holds the stamp. The writer
// is asked for a rewrite only when a busy port's stamp in the last snapshot is missing or
// a minute old, so a port in steady use costs one rewrite a minute.
func TestNoteActivity(t *testing.T) {
	e := newFakeEnv(t, nil)
	socks := map[service.ServicePortName]*trafficSocket{}
	e.wrap = func(s *fakeSocket) ProxySocket {
		ts := &trafficSocket{fakeSocket: s}
		socks[s.port.Name] = ts
		return ts
	}
	e.p.OnServiceAdd(webService(nil))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.2.1"))
	e.synced()
	e.sync()
	web := socks[webHTTP]
	if web == nil {
		t.Fatal("no socket for web")
	}
	lastActive := func() time.Time {
		for sp := range e.p.SnapshotPorts() {
			if sp.Name == webHTTP {
				return sp.LastActive
			}
		}
		t.Fatal("web not in the snapshot")
		return time.Time{}
	}
	t0 := e.clk.Now()
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }

	if e.p.NoteActivity(at(0)) {
		t.Errorf("a port without traffic asks for a rewrite")
	}
	if got := lastActive(); !got.IsZero() {
		t.Errorf("LastActive of a port without traffic = %v; want none", got)
	}
	web.total.Add(3)
	if !e.p.NoteActivity(at(1)) {
		t.Errorf("the first traffic of a port does not ask for a rewrite")
	}
	if got := lastActive(); !got.Equal(at(1)) {
		t.Errorf("LastActive = %v; want %v", got, at(1))
	}
	web.total.Add(1)
	if e.p.NoteActivity(at(2)) {
		t.Errorf("traffic a second after the snapshot took its stamp asks for a rewrite")
	}
	if e.p.NoteActivity(at(70)) {
		t.Errorf("no traffic since the last look asks for a rewrite")
	}
	web.active.Store(1) // a connection still open, none new
	if !e.p.NoteActivity(at(71)) {
		t.Errorf("an open connection whose stamp in the snapshot is 70 s old does not ask for a rewrite")
	}
	if got := lastActive(); !got.Equal(at(71)) {
		t.Errorf("LastActive = %v; want %v", got, at(71))
	}
}

// TestRestoredActivityOutlivesTheRestart: a port used before the crash and not since keeps its
// stamp in the restarted process's snapshots (its clients may come back after the next one).
func TestRestoredActivityOutlivesTheRestart(t *testing.T) {
	e := newFakeEnv(t, nil)
	e.wrap = func(s *fakeSocket) ProxySocket { return &trafficSocket{fakeSocket: s} }
	s := seed("ns", "web", "http", service.TCP, 34001)
	e.p.Reopen([]Seed{s})
	sp := snapPort(s.Name, service.TCP, 34001, "10.244.2.1:8080")
	sp.LastActive = e.clk.Now().Add(-30 * time.Second).Truncate(time.Second)
	e.p.Restore(&snapshot.State{Ports: []snapshot.Port{sp}})
	e.p.paths.reopen()
	e.p.OnServiceAdd(webService(nil))
	e.p.OnEndpointSliceAdd(webSlice("web-1", 8080, "10.244.2.1"))
	e.synced()
	e.sync()
	e.p.NoteActivity(e.clk.Now())
	for got := range e.p.SnapshotPorts() {
		if !got.LastActive.Equal(sp.LastActive) {
			t.Errorf("LastActive after the restart = %v; want the snapshot's %v", got.LastActive, sp.LastActive)
		}
	}
}

// BenchmarkNoteActivity10000Ports is one look of the snapshot writer at the counters of 10,000
// TCP service ports.
func BenchmarkNoteActivity10000Ports(b *testing.B) {
	e := newFakeEnv(b, nil)
	e.wrap = func(s *fakeSocket) ProxySocket { return &trafficSocket{fakeSocket: s} }
	e.synced()
	addServices(e, 10000, sliceEP{addr: "10.244.0.1"})
	e.sync()
	if n := len(e.p.paths.byName); n != 10000 {
		b.Fatal(fmt.Sprintf("%d ports", n))
	}
	b.ReportAllocs()
	cpu0 := procstat.CPUTime(os.Getpid())
	now := e.clk.Now()
	for b.Loop() {
		now = now.Add(time.Second)
		e.p.NoteActivity(now)
	}
	b.ReportMetric(float64(procstat.CPUTime(os.Getpid())-cpu0)/float64(b.N), "cpu-ns/op")
}
