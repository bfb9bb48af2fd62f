package auth

import (
	"container/list"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// cache is a bounded least-recently-used map whose entries also expire: every request to the
// stream would otherwise cost two API calls, and a client sending a stream of random tokens must
// not grow the proxy's memory, so the oldest entry makes room for a new one.
type cache[K comparable, V any] struct {
	clock clock.PassiveClock
	size  int

	mu    sync.Mutex
	order *list.List // of *entry[K, V], most recently used first
	items map[K]*list.Element
}

type entry[K comparable, V any] struct {
	key     K
	value   V
	expires time.Time
}

func newCache[K comparable, V any](clk clock.PassiveClock, size int) *cache[K, V] {
	return &cache[K, V]{clock: clk, size: size, order: list.New(), items: make(map[K]*list.Element, size)}
}

// get returns the value of key unless it is absent or has expired.
func (c *cache[K, V]) get(key K) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.items[key]
	if !ok {
		var zero V
		return zero, false
	}
	e := el.Value.(*entry[K, V])
	if !c.clock.Now().Before(e.expires) {
		c.remove(el)
		var zero V
		return zero, false
	}
	c.order.MoveToFront(el)
	return e.value, true
}

// add stores value under key for ttl, evicting the least recently used entry when full.
func (c *cache[K, V]) add(key K, value V, ttl time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	expires := c.clock.Now().Add(ttl)
	if el, ok := c.items[key]; ok {
		e := el.Value.(*entry[K, V])
		e.value, e.expires = value, expires
		c.order.MoveToFront(el)
		return
	}
	for c.order.Len() >= c.size {
		c.remove(c.order.Back())
	}
	c.items[key] = c.order.PushFront(&entry[K, V]{key: key, value: value, expires: expires})
}

func (c *cache[K, V]) remove(el *list.Element) {
	c.order.Remove(el)
	delete(c.items, el.Value.(*entry[K, V]).key)
}

// len is the number of entries held, expired ones included until they are looked up or evicted.
func (c *cache[K, V]) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.order.Len()
}
