package healthcheck

// clients.go: the per-client limits of one port. A table of at most max client addresses, each
// with a token bucket and a count of its open connections, so that a flood from one address
// spends that address's share only; a flood from many addresses cannot grow the table (the
// least recently seen address without an open connection is forgotten, and comes back with a
// full bucket: the port's own bucket and slots cap what such a flood gets).

import (
	"container/list"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

type clients struct {
	max      int
	rate     rate.Limit
	burst    int
	maxConns int

	mu     sync.Mutex
	byAddr map[netip.Addr]*list.Element // of *client
	recent list.List                    // most recently seen first
}

type client struct {
	addr   netip.Addr
	bucket *rate.Limiter
	conns  int // open connections; an entry with one is never forgotten
}

func newClients(max int, r rate.Limit, burst, maxConns int) *clients {
	return &clients{max: max, rate: r, burst: burst, maxConns: maxConns, byAddr: map[netip.Addr]*list.Element{}}
}

// get finds or adds a's entry and marks it the most recently seen; c.mu is held. It is nil only
// when every entry has an open connection, which cannot happen while max exceeds the port's
// connection slots (withDefaults and the port keep it so): then the port's limits alone apply.
func (c *clients) get(a netip.Addr) *client {
	if e, ok := c.byAddr[a]; ok {
		c.recent.MoveToFront(e)
		return e.Value.(*client)
	}
	if len(c.byAddr) >= c.max && !c.forgetOne() {
		return nil
	}
	cl := &client{addr: a, bucket: rate.NewLimiter(c.rate, c.burst)}
	c.byAddr[a] = c.recent.PushFront(cl)
	return cl
}

// forgetOne removes the least recently seen entry without an open connection. It passes over at
// most the entries with connections, which the port's slots bound.
func (c *clients) forgetOne() bool {
	for e := c.recent.Back(); e != nil; e = e.Prev() {
		if cl := e.Value.(*client); cl.conns == 0 {
			c.recent.Remove(e)
			delete(c.byAddr, cl.addr)
			return true
		}
	}
	return false
}

// allow takes a token of a's bucket at now.
func (c *clients) allow(a netip.Addr, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	cl := c.get(a)
	return cl == nil || cl.bucket.AllowN(now, 1)
}

// open counts a connection of a, unless a holds maxConns already.
func (c *clients) open(a netip.Addr) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	cl := c.get(a)
	if cl == nil {
		return true
	}
	if cl.conns >= c.maxConns {
		return false
	}
	cl.conns++
	return true
}

// closed uncounts a connection of a that open counted.
func (c *clients) closed(a netip.Addr) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.byAddr[a]; ok && e.Value.(*client).conns > 0 {
		e.Value.(*client).conns--
	}
}

// size is how many addresses the table holds.
func (c *clients) size() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.byAddr)
}
