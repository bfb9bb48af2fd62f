package loadbalancer

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// affinityShards spreads clients over independently locked maps so that picks of different clients
// rarely contend and a cleanup sweep holds one small lock at a time.
const affinityShards = 32

type affinityEntry struct {
	endpoint netip.AddrPort // immutable: a re-pick stores a new entry
	lastUsed atomic.Int64   // unix nanoseconds; bumped under the read lock
}

type affinityShard struct {
	mu sync.RWMutex
	m  map[netip.Addr]*affinityEntry
	_  [32]byte // keep neighbouring shard locks off one cache line
}

type affinityTable struct {
	shards [affinityShards]affinityShard
}

func (t *affinityTable) init() {
	for i := range t.shards {
		t.shards[i].m = make(map[netip.Addr]*affinityEntry)
	}
}

// shard hashes the client address (FNV-1a over its 16-byte form) without allocating.
func (t *affinityTable) shard(client netip.Addr) *affinityShard {
	b := client.As16()
	h := uint32(2166136261)
	for _, c := range b {
		h ^= uint32(c)
		h *= 16777619
	}
	return &t.shards[h%affinityShards]
}

func (sh *affinityShard) get(client netip.Addr) *affinityEntry {
	sh.mu.RLock()
	e := sh.m[client]
	sh.mu.RUnlock()
	return e
}

func (sh *affinityShard) put(client netip.Addr, ep netip.AddrPort, now int64) {
	e := &affinityEntry{endpoint: ep}
	e.lastUsed.Store(now)
	sh.mu.Lock()
	sh.m[client] = e
	sh.mu.Unlock()
}

func (t *affinityTable) removeIf(drop func(*affinityEntry) bool) int {
	n := 0
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		for client, e := range sh.m {
			if drop(e) {
				delete(sh.m, client)
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}

func (t *affinityTable) entries() []AffinityEntry {
	var out []AffinityEntry
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.RLock()
		for client, e := range sh.m {
			out = append(out, AffinityEntry{Client: client, Endpoint: e.endpoint, LastUsed: time.Unix(0, e.lastUsed.Load())})
		}
		sh.mu.RUnlock()
	}
	return out
}
