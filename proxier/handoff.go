package proxier

// handoff.go: a proxy that handed its sockets to a successor (package handover) stops syncing
// and accepting at once, leaves the portal rules as they are (the successor's are the same: it
// serves the same proxy ports), and lets the connections and UDP sessions it has finish before it
// ends the rest.

import (
	"context"
	"sync"

	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// handOffState is HandOff's request to Run.
type handOffState struct {
	mu       sync.Mutex
	stopSync context.CancelFunc // set by Run
	drain    context.Context    // set by HandOff
}

// releaser is a socket that can stop accepting new clients but keep what it has (both proxies).
type releaser interface{ Release() }

// drainWaiter is a socket that says when its last connection or session has ended after Release.
type drainWaiter interface{ Drained() <-chan struct{} }

// HandOff stops the sync loop and makes Run, instead of ending every connection, stop accepting
// on every proxy socket and wait until their established connections and UDP sessions have
// finished, or drain is done; then it ends the rest and returns. The portal rules stay in place.
// Call it once a successor serves the same sockets.
func (p *Proxier) HandOff(drain context.Context) {
	h := &p.handOff
	h.mu.Lock()
	defer h.mu.Unlock()
	h.drain = drain
	if h.stopSync != nil {
		h.stopSync()
	}
}

// syncContext is ctx, ended early by HandOff.
func (p *Proxier) syncContext(ctx context.Context) context.Context {
	h := &p.handOff
	h.mu.Lock()
	defer h.mu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	h.stopSync = cancel
	if h.drain != nil {
		cancel()
	}
	return ctx
}

// drain releases every socket and waits for them to drain, if HandOff asked for it.
func (p *Proxier) drain() {
	h := &p.handOff
	h.mu.Lock()
	drain := h.drain
	h.mu.Unlock()
	if drain == nil {
		return
	}
	start := p.cfg.Clock.Now()
	var socks []ProxySocket
	p.paths.mu.RLock()
	for _, path := range p.paths.byName {
		for _, sock := range path.sockets() {
			socks = append(socks, members(sock)...)
		}
	}
	p.paths.mu.RUnlock()
	for _, s := range socks {
		if r, ok := s.(releaser); ok {
			r.Release()
		}
	}
	waiting := 0
	for _, s := range socks {
		d, ok := s.(drainWaiter)
		if !ok {
			continue
		}
		select {
		case <-d.Drained():
			continue
		default:
		}
		select {
		case <-d.Drained():
		case <-drain.Done():
			waiting++
		}
	}
	log := p.log.WithField("duration", p.cfg.Clock.Since(start).String())
	if waiting > 0 {
		log.WithField("sockets", waiting).Warn("Handed over: ending the connections still open at the drain deadline")
		return
	}
	log.Info("Handed over: every established connection and UDP session has finished")
}

// members are the sockets a socket is made of (a multiSocket has several).
func members(s ProxySocket) []ProxySocket {
	m, ok := s.(*multiSocket)
	if !ok {
		return []ProxySocket{s}
	}
	var out []ProxySocket
	for _, s := range m.socks {
		out = append(out, members(s)...)
	}
	return out
}

// FirstSync is closed once the first portal sync has worked: every socket of the Services known
// then is open and the portals point at them. A successor tells its predecessor it is ready then.
func (p *Proxier) FirstSync() <-chan struct{} { return p.firstSync }

// Serving is closed once Run has reopened the sockets of the seeds (Reopen), the first thing it
// does: from then on the proxy ports the rules in force point at accept again. The daemon times
// its start-up by it.
func (p *Proxier) Serving() <-chan struct{} { return p.serving }

// EndpointsReady is closed once the initial Services and EndpointSlices are in (before Run, if
// the sources run first): a successor of a hand-over starts Run only then, so its reopened
// sockets never hold a connection its predecessor could have served at once.
func (p *Proxier) EndpointsReady() <-chan struct{} { return p.endpointsReady }

func (p *Proxier) markFirstSync() { p.firstSyncOnce.Do(func() { close(p.firstSync) }) }

// ReopenCounts says how many service ports Run reopened, before the first sync, on the proxy
// ports the portal rules in force point at (Reopen); how many of their sockets it had to bind
// anew (not handed over by a running predecessor: the SIGKILL path); and how many service ports
// it could not reopen (their first sync allocates another proxy port and rewrites their rules).
func (p *Proxier) ReopenCounts() (reopened, reboundSockets, reallocated int) {
	return int(p.paths.restart.reopened.Load()), int(p.paths.restart.rebound.Load()), int(p.paths.restart.reallocated.Load())
}

// adopter is a socket that says whether it took a handed-over socket (both proxies).
type adopter interface{ Adopted() bool }

var (
	_ adopter = (*tcp.Proxy)(nil)
	_ adopter = (*udp.Proxy)(nil)
)
