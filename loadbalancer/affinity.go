package loadbalancer

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
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

// putIfAbsent stores an entry unless the client has one.
func (sh *affinityShard) putIfAbsent(client netip.Addr, ep netip.AddrPort, lastUsed int64) bool {
	e := &affinityEntry{endpoint: ep}
	e.lastUsed.Store(lastUsed)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if _, ok := sh.m[client]; ok {
		return false
	}
	sh.m[client] = e
	return true
}

// ImportAffinity adds sticky clients a predecessor process handed over (a planned restart) to a
// service port's table, so they keep their endpoint. An entry is taken only while the port has
// ClientIP affinity on, for an endpoint of its current set, within the TTL, and never over an
// entry of this process's own (a pick made since is the newer). It returns how many it took.
func (lb *LoadBalancer) ImportAffinity(name service.ServicePortName, entries []AffinityEntry) int {
	s := lb.lookup(name)
	if s == nil {
		return 0
	}
	return s.importAffinity(entries)
}

func (s *Service) importAffinity(entries []AffinityEntry) int {
	s.writeMu.Lock() // no endpoint or affinity update between the checks and the puts
	defer s.writeMu.Unlock()
	t := s.affinity.Load()
	if t == nil || !s.clientIP.Load() {
		return 0
	}
	set := s.eps.Load()
	now, ttl := s.clock.Now().UnixNano(), s.ttl.Load()
	n := 0
	for _, e := range entries {
		used := e.LastUsed.UnixNano()
		if !e.Client.IsValid() || set.get(e.Endpoint) == nil || now-used >= ttl {
			continue
		}
		if t.shard(e.Client).putIfAbsent(e.Client, e.Endpoint, min(used, now)) {
			n++
		}
	}
	return n
}
