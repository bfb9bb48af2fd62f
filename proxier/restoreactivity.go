package proxier

// restoreactivity.go: when each service port last carried traffic, kept in the restart snapshot
// so that a restarted proxy reopens the ports its node's clients were using first. At 10,000
// ports the reopen takes most of a second beside busy CPUs; in name order, a port late in the
// alphabet was refused for all of it, however busy, while ports nobody had used in days came
// first. Activity is read from the counters every socket keeps anyway (flow.Stats: accepted
// connections and created sessions, live ones), at the snapshot writer's pace, so the data path
// pays nothing for it.

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// activityRefresh is how stale a busy port's stamp in the last snapshot may grow before
// NoteActivity asks for a rewrite: a port in steady use costs one rewrite a minute, not one per
// check, and a port that was idle longer than that asks for one at once.
const activityRefresh = 60 // seconds

// activity is what NoteActivity keeps per service port.
type activity struct {
	mu    sync.Mutex
	ports map[service.ServicePortName]*portActivity
	round uint64 // NoteActivity's calls, to drop the ports it no longer finds
}

type portActivity struct {
	total uint64 // the sockets' accepted connections and created sessions at the last look
	last  int64  // unix seconds of the last look that found traffic (or the restored snapshot's); 0: none
	filed int64  // last as the latest snapshot taken (SnapshotPorts) holds it
	round uint64
}

// NoteActivity looks at every open proxy socket's counters and stamps the service ports that
// accepted a connection or created a UDP session since the last look, or still have one open, with
// now (to the second). It reports whether the last snapshot taken misses some of it: a port active
// now whose stamp there is missing or older than activityRefresh. The snapshot writer calls it
// periodically; it is safe to call from any goroutine.
func (p *Proxier) NoteActivity(now time.Time) (stale bool) {
	a := &p.eps.restore.activity
	sec := now.Unix()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.ports == nil {
		a.ports = make(map[service.ServicePortName]*portActivity)
	}
	a.round++
	d := p.paths
	d.mu.RLock()
	for name, ap := range d.socketPaths() {
		st, ok := socketStats(ap.sock)
		if ap.ext != nil {
			ext, extOK := socketStats(ap.ext.sock)
			st.Add(ext)
			ok = ok || extOK
		}
		if !ok {
			continue
		}
		e := a.ports[name]
		if e == nil {
			e = &portActivity{}
			a.ports[name] = e
		}
		// A socket opened anew (other options) counts from 0 again: only a rise is traffic.
		if st.Total > e.total || st.Active > 0 {
			e.last = sec
			if sec-e.filed >= activityRefresh {
				stale = true
			}
		}
		e.total, e.round = st.Total, a.round
	}
	d.mu.RUnlock()
	for name, e := range a.ports {
		if e.round != a.round { // gone, or on the kernel path (not in the snapshot)
			delete(a.ports, name)
		}
	}
	return stale
}

// lastActive is a port's stamp for the snapshot being taken, which it then holds.
func (a *activity) lastActive(name service.ServicePortName) time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.ports[name]
	if e == nil || e.last == 0 {
		return time.Time{}
	}
	e.filed = e.last
	return time.Unix(e.last, 0)
}

// restored takes a restored snapshot's stamp of a port, so a port not used since the restart
// keeps it in the next snapshot. NoteActivity, which runs only after the first sync, drops it if
// it does not find the port open.
func (a *activity) restored(name service.ServicePortName, at time.Time) {
	if at.IsZero() {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.ports == nil {
		a.ports = make(map[service.ServicePortName]*portActivity)
	}
	sec := at.Unix()
	a.ports[name] = &portActivity{last: sec, filed: sec}
}

// byActivity orders seeds as the reopen should open them: the most recently active first, the
// others (never active, or not in the snapshot) after them in their order. Few ports of a node
// are usually active: they are sorted, the rest only moved (at 10,000 seeds a sort of all of
// them by a map lookup per comparison cost more than the partition).
func byActivity(seeds []Seed, last func(service.ServicePortName) int64) {
	type stamped struct {
		seed Seed
		at   int64
	}
	var active []stamped
	rest := seeds[:0:0]
	for _, s := range seeds {
		if t := last(s.Name); t != 0 {
			active = append(active, stamped{s, t})
		} else if active != nil {
			rest = append(rest, s)
		}
	}
	if active == nil {
		return
	}
	// rest holds the inactive seeds after the first active one; those before it are in place.
	slices.SortStableFunc(active, func(x, y stamped) int { return cmp.Compare(y.at, x.at) })
	head := len(seeds) - len(active) - len(rest) // inactive seeds before the first active one
	copy(seeds[len(active):], seeds[:head])
	for i, a := range active {
		seeds[i] = a.seed
	}
	copy(seeds[len(active)+head:], rest)
}
