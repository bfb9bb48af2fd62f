package proxier

import (
	"slices"
	"sort"
	"sync"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// serviceChange is the net effect of the events seen for one Service since the last sync: the
// ports it had when the first event arrived (previous) and the ports it has now (current). nil
// means "did not exist".
type serviceChange struct {
	previous []*service.Port
	current  []*service.Port
}

// serviceChangeTracker coalesces Service events between syncs, with the legacy semantics: the
// oldest previous and the newest current are kept, and a change that nets out to nothing is
// dropped (add then delete, or an update back to the original).
type serviceChangeTracker struct {
	mu    sync.Mutex
	items map[service.NamespacedName]*serviceChange
}

func newServiceChangeTracker() *serviceChangeTracker {
	return &serviceChangeTracker{items: make(map[service.NamespacedName]*serviceChange)}
}

// update records an event; previous is ignored when a change is already pending for name. It
// reports whether a change is pending for name afterwards.
func (t *serviceChangeTracker) update(name service.NamespacedName, previous, current []*service.Port) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	ch, ok := t.items[name]
	if !ok {
		ch = &serviceChange{previous: previous}
		t.items[name] = ch
	}
	ch.current = current
	if portsEqual(ch.previous, ch.current) {
		delete(t.items, name)
		return false
	}
	return true
}

// take returns the pending changes and starts a new batch.
func (t *serviceChangeTracker) take() map[service.NamespacedName]*serviceChange {
	t.mu.Lock()
	defer t.mu.Unlock()
	items := t.items
	t.items = make(map[service.NamespacedName]*serviceChange)
	return items
}

func (t *serviceChangeTracker) pending() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.items)
}

func portsEqual(a, b []*service.Port) bool {
	if (a == nil) != (b == nil) {
		return false
	}
	return slices.EqualFunc(a, b, func(x, y *service.Port) bool { return x.Equal(y) })
}

// endpointSliceCache holds the slim form of every EndpointSlice, grouped by owning Service.
type endpointSliceCache struct {
	mu     sync.Mutex
	slices map[service.NamespacedName]map[string]*slimSlice
}

func newEndpointSliceCache() *endpointSliceCache {
	return &endpointSliceCache{slices: make(map[service.NamespacedName]map[string]*slimSlice)}
}

// update stores (or, with s == nil, removes) one slice of a Service.
func (c *endpointSliceCache) update(owner service.NamespacedName, sliceName string, s *slimSlice) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.slices[owner]
	if s == nil {
		if _, ok := m[sliceName]; !ok {
			return
		}
		delete(m, sliceName)
		if len(m) == 0 {
			delete(c.slices, owner)
		}
	} else {
		if m == nil {
			m = make(map[string]*slimSlice)
			c.slices[owner] = m
		}
		m[sliceName] = s
	}
}

// get returns the slices of a Service in name order.
func (c *endpointSliceCache) get(owner service.NamespacedName) []*slimSlice {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.slices[owner]
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	sort.Strings(names)
	out := make([]*slimSlice, len(names))
	for i, n := range names {
		out[i] = m[n]
	}
	return out
}
