package handover

// Address plan: clients in 10.244.1.0/24, endpoints in 10.244.2.0/24 (documentation-free test
// values, never dialled); the hand-over socket in the test's temporary directory.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

var addrs = cmpopts.EquateComparable(netip.Addr{}, netip.AddrPort{})

var web = service.ServicePortName{Namespace: "default", Name: "web", Port: "http"}

func affinityEntries(n int) []AffinityEntry {
	out := make([]AffinityEntry, n)
	for i := range out {
		out[i] = AffinityEntry{Service: web, Client: netip.AddrFrom4([4]byte{10, 244, byte(1 + i/250), byte(1 + i%250)}),
			Endpoint: netip.MustParseAddrPort("10.244.2.3:8080"), Idle: time.Duration(i) * time.Millisecond}
	}
	return out
}

func stringsOf(bs [][]byte) []string {
	out := make([]string, len(bs))
	for i, b := range bs {
		out[i] = string(b)
	}
	return out
}

// serveAffinity runs a predecessor whose affinity table is entries (nil: a build without it).
func serveAffinity(t *testing.T, path string, entries func() []AffinityEntry) {
	t.Helper()
	s := NewServer(ServerConfig{Path: path, Logger: quietLog(), Collect: func() ([]socket, error) { return nil, nil }, Affinity: entries})
	if err := s.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx, func() {}) }()
	t.Cleanup(func() { cancel(); <-done })
}

func TestHandOverAffinity(t *testing.T) {
	t.Run("the table arrives whole, over several messages", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "handover.sock")
		want := affinityEntries(3000) // ~80 bytes each: four or more messages
		serveAffinity(t, path, func() []AffinityEntry { return want })
		in := receiveOK(t, path)
		if diff := cmp.Diff(want, in.Affinity(), addrs); diff != "" {
			t.Fatalf("affinity (-want +got):\n%s", diff)
		}
		if n, why := in.AffinityDropped(); n != 0 {
			t.Fatalf("dropped %d: %v", n, why)
		}
	})

	t.Run("a predecessor without the table (an older build) hands over without it", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "handover.sock")
		serveAffinity(t, path, nil)
		in := receiveOK(t, path)
		if got := in.Affinity(); len(got) != 0 {
			t.Fatalf("affinity %v, want none", got)
		}
	})

	t.Run("a successor that does not ask (an older build) is sent none", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "handover.sock")
		serveAffinity(t, path, func() []AffinityEntry { return affinityEntries(10) })
		c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if err := send(c, hello{Version: Version}, nil); err != nil { // version 1, as before the table
			t.Fatal(err)
		}
		var h header
		if _, err := receive(c, &h); err != nil {
			t.Fatal(err)
		}
		if h.Affinity != 0 || h.Sockets != 0 || h.Chunks != 0 {
			t.Fatalf("header %+v: want no sockets and no affinity messages", h)
		}
	})

	t.Run("the most recently used entries are kept over the bound", func(t *testing.T) {
		all := affinityEntries(1000)
		slices.Reverse(all) // the most recently used last
		msgs, left, err := encodeAffinity(all, 100)
		if err != nil || left != 900 {
			t.Fatalf("encodeAffinity: %d left, %v; want 900 left", left, err)
		}
		got := strings.Join(stringsOf(msgs), "")
		if !strings.Contains(got, `"c":"10.244.1.1"`) || !strings.Contains(got, `"c":"10.244.1.100"`) || strings.Contains(got, `"c":"10.244.1.101"`) {
			t.Fatalf("want the 100 most recently used clients 10.244.1.1-100, got %.300s", got)
		}
	})

	t.Run("the largest entries fit the bound of messages a header may announce", func(t *testing.T) {
		long := strings.Repeat("x", maxNameLen)
		e := AffinityEntry{Service: service.ServicePortName{Namespace: long, Name: long, Port: long},
			Client: netip.MustParseAddr("fd00:244:ffff:ffff:ffff:ffff:ffff:ffff"), Endpoint: netip.MustParseAddrPort("[fd00:245:ffff:ffff:ffff:ffff:ffff:ffff]:65535"), Idle: maxAffinityIdle}
		msgs, left, err := encodeAffinity([]AffinityEntry{e, e, e, e}, maxAffinityEntries)
		if err != nil || left != 0 || len(msgs) != 1 {
			t.Fatalf("encodeAffinity: %d messages, %d left, %v; want one message", len(msgs), left, err)
		}
		perMsg := affinityChunkBytes / (len(msgs[0]) / 4)
		if need := maxAffinityEntries/perMsg + 1; need > maxAffinityChunks {
			t.Fatalf("%d entries of %d bytes need %d messages, over the bound %d", maxAffinityEntries, len(msgs[0])/4, need, maxAffinityChunks)
		}
	})
}

func TestAffinityEntryChecks(t *testing.T) {
	good := affinityWire{Namespace: "default", Name: "web", Port: "http", Client: "10.244.1.5", Endpoint: "10.244.2.3:8080", IdleMs: 1500}
	for _, tc := range []struct {
		name string
		edit func(*affinityWire)
		ok   bool
	}{
		{"a good entry", func(*affinityWire) {}, true},
		{"an unnamed port", func(w *affinityWire) { w.Port = "" }, true},
		{"an IPv4-mapped client is unmapped", func(w *affinityWire) { w.Client = "::ffff:10.244.1.5" }, true},
		{"no namespace", func(w *affinityWire) { w.Namespace = "" }, false},
		{"a name too long", func(w *affinityWire) { w.Name = strings.Repeat("x", 254) }, false},
		{"a client that is no address", func(w *affinityWire) { w.Client = "pod-a" }, false},
		{"an unspecified client", func(w *affinityWire) { w.Client = "0.0.0.0" }, false},
		{"a client with a zone", func(w *affinityWire) { w.Client = "fe80::1%eth0" }, false},
		{"an endpoint without a port", func(w *affinityWire) { w.Endpoint = "10.244.2.3:0" }, false},
		{"an endpoint that is no address", func(w *affinityWire) { w.Endpoint = "pod-b:80" }, false},
		{"a negative idle time", func(w *affinityWire) { w.IdleMs = -1 }, false},
		{"an idle time over a day", func(w *affinityWire) { w.IdleMs = int64(25 * time.Hour / time.Millisecond) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := good
			tc.edit(&w)
			e, err := w.decode()
			if (err == nil) != tc.ok {
				t.Fatalf("decode(%+v) = %+v, %v; want ok %v", w, e, err, tc.ok)
			}
			if err == nil && (e.Client.Is4In6() || e.Endpoint.Addr().Is4In6()) {
				t.Fatalf("decode kept a mapped address: %+v", e)
			}
		})
	}
}

// TestReceiveDropsBadAffinity: bad entries and messages are dropped and counted, the good ones
// kept, and the hand-over of the sockets goes on.
func TestReceiveDropsBadAffinity(t *testing.T) {
	path := filepath.Join(t.TempDir(), "handover.sock")
	uln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer uln.Close()
	good := `{"ns":"default","n":"web","p":"http","c":"10.244.1.5","e":"10.244.2.3:8080","i":1500}`
	msgs := [][]byte{
		[]byte(`{"version":1,"sockets":0,"chunks":0,"affinity":3}`),
		[]byte(fmt.Sprintf(`{"affinity":[%s,{"ns":"","n":"x","c":"10.244.1.6","e":"10.244.2.3:8080"},7]}`, good)),
		[]byte(`{"affinity":`),
		[]byte(`{"affinity":[]}`),
	}
	done := fakePredecessor(uln, msgs, nil)
	in, err := Receive(t.Context(), path, 5*time.Second)
	if err != nil {
		t.Fatalf("Receive: %v", err)
	}
	in.Close()
	<-done
	want := []AffinityEntry{{Service: web, Client: netip.MustParseAddr("10.244.1.5"), Endpoint: netip.MustParseAddrPort("10.244.2.3:8080"), Idle: 1500 * time.Millisecond}}
	if diff := cmp.Diff(want, in.Affinity(), addrs); diff != "" {
		t.Fatalf("affinity (-want +got):\n%s", diff)
	}
	if n, why := in.AffinityDropped(); n != 3 || why == nil {
		t.Fatalf("dropped %d (%v); want 3 (an entry without a namespace, one that is not an object, a message that does not decode)", n, why)
	}
}

// BenchmarkAffinityRoundTrip is the cost of encoding 10,000 entries into messages and decoding
// and checking them on the successor's side (the socket itself left out).
func BenchmarkAffinityRoundTrip(b *testing.B) {
	entries := affinityEntries(10000)
	b.ReportAllocs()
	for b.Loop() {
		msgs, _, err := encodeAffinity(entries, maxAffinityEntries)
		if err != nil {
			b.Fatal(err)
		}
		in := &Inherited{}
		for _, m := range msgs {
			var chunk affinityChunk
			if err := json.Unmarshal(m, &chunk); err != nil {
				b.Fatal(err)
			}
			for _, raw := range chunk.Affinity {
				var w affinityWire
				if err := json.Unmarshal(raw, &w); err != nil {
					b.Fatal(err)
				}
				e, err := w.decode()
				if err != nil {
					b.Fatal(err)
				}
				in.affinity = append(in.affinity, e)
			}
		}
	}
}
