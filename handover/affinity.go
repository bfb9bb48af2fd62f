package handover

// affinity.go: the ClientIP affinity table travels with the sockets, so that a planned restart
// does not move sticky clients to another endpoint. It is an optional part of protocol version 1:
// a successor that takes it says so in its hello ("affinity":true); a predecessor that has it
// announces its messages in the header ("affinity":K) and sends them after the socket chunks,
// before the successor's adopted. A peer without the field (an older build) ignores the other's
// (unknown JSON fields are skipped) and nothing is sent: no affinity, as before. The header bounds
// the messages; each entry is checked on receipt, and a bad one is dropped and counted, never
// taken (Inherited.Affinity, AffinityDropped).

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// AffinityEntry is one client's sticky endpoint on a service port (ClientIP session affinity).
type AffinityEntry struct {
	Service  service.ServicePortName
	Client   netip.Addr
	Endpoint netip.AddrPort
	// Idle is how long ago the client last used the endpoint: the successor's TTL counts on
	// from there.
	Idle time.Duration
}

const (
	// maxAffinityEntries bounds the entries sent and taken: 64 Ki clients, about 5 MB of
	// messages, well within the hand-over's 5 s (10,000 entries cost 72-79 ms to encode, send
	// and check at load 1.6); beyond it the most recently used are kept.
	maxAffinityEntries = 1 << 16
	// maxAffinityChunks bounds the messages a header may announce: an entry takes at most
	// about 900 bytes (names of 253 bytes), so a message holds 60 or more.
	maxAffinityChunks = maxAffinityEntries/60 + 1
	// affinityChunkBytes is what a message's entries may take, under maxMessage with room for
	// the envelope.
	affinityChunkBytes = maxMessage - 1024
	// maxAffinityIdle is the longest ClientIP timeout the API allows (timeoutSeconds 86400).
	maxAffinityIdle = 24 * time.Hour
	maxNameLen      = 253
)

// affinityWire is an entry on the wire.
type affinityWire struct {
	Namespace string `json:"ns"`
	Name      string `json:"n"`
	Port      string `json:"p,omitempty"`
	Client    string `json:"c"`
	Endpoint  string `json:"e"`
	IdleMs    int64  `json:"i"`
}

type affinityChunk struct {
	Affinity []json.RawMessage `json:"affinity"`
}

// encodeAffinity cuts entries into messages of at most affinityChunkBytes, keeping at most limit
// (maxAffinityEntries; the most recently used). It returns the messages and how many entries
// were left out.
func encodeAffinity(entries []AffinityEntry, limit int) (msgs [][]byte, left int, err error) {
	if len(entries) > limit {
		entries = slices.Clone(entries)
		slices.SortFunc(entries, func(a, b AffinityEntry) int { return cmp.Compare(a.Idle, b.Idle) })
		left = len(entries) - limit
		entries = entries[:limit]
	}
	// A message is {"affinity":[e1,e2,...]}, assembled from the entries' own encodings (a
	// json.Marshal of the whole would validate and copy each again).
	const head, tail = `{"affinity":[`, `]}`
	var cur []byte
	flush := func() {
		if len(cur) > 0 {
			msgs, cur = append(msgs, append(cur, tail...)), nil
		}
	}
	for _, e := range entries {
		b, err := json.Marshal(affinityWire{Namespace: e.Service.Namespace, Name: e.Service.Name, Port: e.Service.Port,
			Client: e.Client.String(), Endpoint: e.Endpoint.String(), IdleMs: max(e.Idle, 0).Milliseconds()})
		if err != nil {
			return nil, 0, err
		}
		if len(b) > affinityChunkBytes/8 {
			left++ // names no API object has: not worth a message
			continue
		}
		if len(cur)+len(b)+1+len(tail) > affinityChunkBytes {
			flush()
		}
		if len(cur) == 0 {
			cur = append(make([]byte, 0, affinityChunkBytes), head...)
		} else {
			cur = append(cur, ',')
		}
		cur = append(cur, b...)
	}
	flush()
	return msgs, left, nil
}

// decode checks one entry: names of an API object's length, a client address, an endpoint with
// an address and a port, an idle time within the API's longest timeout.
func (w affinityWire) decode() (AffinityEntry, error) {
	if w.Namespace == "" || w.Name == "" || len(w.Namespace) > maxNameLen || len(w.Name) > maxNameLen || len(w.Port) > maxNameLen {
		return AffinityEntry{}, fmt.Errorf("service name %.100q/%.100q:%.100q", w.Namespace, w.Name, w.Port)
	}
	client, err := netip.ParseAddr(w.Client)
	if err != nil || client.Zone() != "" || client.IsUnspecified() {
		return AffinityEntry{}, fmt.Errorf("client %.60q", w.Client)
	}
	ep, err := netip.ParseAddrPort(w.Endpoint)
	if err != nil || ep.Port() == 0 || ep.Addr().Zone() != "" || ep.Addr().IsUnspecified() {
		return AffinityEntry{}, fmt.Errorf("endpoint %.60q", w.Endpoint)
	}
	idle := time.Duration(w.IdleMs) * time.Millisecond
	if w.IdleMs < 0 || idle > maxAffinityIdle {
		return AffinityEntry{}, fmt.Errorf("idle time %dms", w.IdleMs)
	}
	return AffinityEntry{Service: service.ServicePortName{Namespace: w.Namespace, Name: w.Name, Port: w.Port},
		Client: client.Unmap(), Endpoint: netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port()), Idle: idle}, nil
}

// receiveAffinity reads n affinity messages. A message that does not decode, or that came with
// descriptors (closed), loses its entries; a bad entry is dropped alone. Only a failed read (the
// peer gone, the deadline) is an error: the hand-over then fails as on any failed read.
func (in *Inherited) receiveAffinity(c *net.UnixConn, n int) error {
	for range n {
		b, fds, err := receiveRaw(c)
		if err != nil {
			return fmt.Errorf("read affinity: %w", err)
		}
		if len(fds) > 0 {
			closeAll(fds)
			in.dropAffinity(1, errors.New("an affinity message came with descriptors"))
			continue
		}
		var chunk affinityChunk
		if err := json.Unmarshal(b, &chunk); err != nil {
			in.dropAffinity(1, fmt.Errorf("an affinity message does not decode: %w", err))
			continue
		}
		for _, raw := range chunk.Affinity {
			var w affinityWire
			err := json.Unmarshal(raw, &w)
			var e AffinityEntry
			if err == nil {
				e, err = w.decode()
			}
			switch {
			case err != nil:
				in.dropAffinity(1, err)
			case len(in.affinity) >= maxAffinityEntries:
				in.dropAffinity(1, fmt.Errorf("over %d entries", maxAffinityEntries))
			default:
				in.affinity = append(in.affinity, e)
			}
		}
	}
	return nil
}

func (in *Inherited) dropAffinity(n int, why error) {
	if in.affinityDropped == 0 {
		in.affinityWhy = why
	}
	in.affinityDropped += n
}

// Affinity is the predecessor's affinity table, every entry checked; empty when it sent none (an
// older build, or no ClientIP client). Safe on a nil *Inherited.
func (in *Inherited) Affinity() []AffinityEntry {
	if in == nil {
		return nil
	}
	return in.affinity
}

// AffinityDropped is how many entries (or whole messages) were dropped on receipt, and why the
// first was.
func (in *Inherited) AffinityDropped() (int, error) {
	if in == nil {
		return 0, nil
	}
	return in.affinityDropped, in.affinityWhy
}
