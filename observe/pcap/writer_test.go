package pcap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// block is one pcapng block read back.
type pcapngBlock struct {
	typ  uint32
	body []byte
}

// readBlocks splits a pcapng file into blocks, checking each block's framing.
func readBlocks(t *testing.T, b []byte) []pcapngBlock {
	t.Helper()
	var out []pcapngBlock
	for len(b) > 0 {
		if len(b) < 12 {
			t.Fatalf("%d bytes left, less than a block", len(b))
		}
		n := int(binary.LittleEndian.Uint32(b[4:]))
		if n%4 != 0 || n < 12 || n > len(b) || int(binary.LittleEndian.Uint32(b[n-4:])) != n {
			t.Fatalf("block of type %#x: bad length %d (trailer %d, %d bytes left)", binary.LittleEndian.Uint32(b), n, binary.LittleEndian.Uint32(b[n-4:]), len(b))
		}
		out = append(out, pcapngBlock{binary.LittleEndian.Uint32(b), b[8 : n-4]})
		b = b[n:]
	}
	return out
}

// TestEmptyCapture: a Writer closed with no item leaves a file with its section header and
// interface (raw IP) and nothing else, and nothing is written before the first item.
func TestEmptyCapture(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf, Options{})
	if buf.Len() != 0 {
		t.Fatalf("NewWriter wrote %d bytes", buf.Len())
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	blocks := readBlocks(t, buf.Bytes())
	if len(blocks) != 2 || blocks[0].typ != blockSHB || blocks[1].typ != blockIDB {
		t.Fatalf("blocks %v, want a section header and an interface", blocks)
	}
	if m := binary.LittleEndian.Uint32(blocks[0].body); m != byteOrderMagic {
		t.Errorf("byte-order magic %#x", m)
	}
	if lt := binary.LittleEndian.Uint16(blocks[1].body); lt != linkTypeRaw {
		t.Errorf("link type %d, want %d", lt, linkTypeRaw)
	}
	if err := w.WriteItem(flowItem(1, "TCP", "start", v4, 0)); !errors.Is(err, ErrClosed) {
		t.Errorf("WriteItem after Close: %v, want %v", err, ErrClosed)
	}
}

// TestEnhancedPacketBlocks: each packet is an Enhanced Packet Block on interface 0 with its
// time in microseconds and whole (captured length = original length).
func TestEnhancedPacketBlocks(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf, Options{})
	for _, it := range []*observe.Item{
		flowItem(1, "TCP", "start", v4, 1500*time.Microsecond),
		{Lost: &observe.Lost{Count: 3, Reason: observe.LostRate}},
	} {
		if err := w.WriteItem(it); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	blocks := readBlocks(t, buf.Bytes())[2:]
	if len(blocks) != 3 {
		t.Fatalf("%d packets, want the 3 of a handshake", len(blocks))
	}
	want := uint64(t0.Add(1500 * time.Microsecond).UnixMicro())
	for i, b := range blocks {
		ts := uint64(binary.LittleEndian.Uint32(b.body[4:]))<<32 | uint64(binary.LittleEndian.Uint32(b.body[8:]))
		capLen, origLen := binary.LittleEndian.Uint32(b.body[12:]), binary.LittleEndian.Uint32(b.body[16:])
		if b.typ != blockEPB || binary.LittleEndian.Uint32(b.body) != 0 || ts != want || capLen != origLen || b.body[20]>>4 != 4 {
			t.Errorf("packet %d: type %#x, interface %d, time %d (want %d), lengths %d/%d, IP version %d",
				i, b.typ, binary.LittleEndian.Uint32(b.body), ts, want, capLen, origLen, b.body[20]>>4)
		}
	}
	if st := w.Stats(); st.Lost != 3 || st.Packets != 3 || st.Bytes != int64(buf.Len()) {
		t.Errorf("stats %+v: want Lost 3, Packets 3, Bytes %d", st, buf.Len())
	}
}

// failingWriter fails every write.
type failingWriter struct{}

var errDisk = errors.New("disk full")

func (failingWriter) Write([]byte) (int, error) { return 0, errDisk }

// TestWriteError: the underlying writer's error comes back, wrapped, from the call that meets
// it (Close at the latest, since writes are buffered) and from every call after.
func TestWriteError(t *testing.T) {
	w := NewWriter(failingWriter{}, Options{})
	items, _ := httpFlow(1, v4) // more than the buffer holds
	var err error
	for _, it := range items {
		if err = w.WriteItem(it); err != nil {
			break
		}
	}
	if !errors.Is(err, errDisk) {
		t.Errorf("WriteItem: %v, want %v", err, errDisk)
	}
	if err := w.Close(); !errors.Is(err, errDisk) {
		t.Errorf("Close: %v, want %v", err, errDisk)
	}
}

// TestMaxFlowsForgetsTheLeastRecentlyActive: past MaxFlows, the flow least recently active is
// forgotten: its later payload waits as if unseen, and is dropped at Close.
func TestMaxFlowsForgetsTheLeastRecentlyActive(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf, Options{MaxFlows: 2})
	for _, it := range []*observe.Item{
		flowItem(1, "TCP", "start", v4, 0),
		flowItem(2, "TCP", "start", v6, 0),
		payloadItem(1, observe.DirToEndpoint, []byte("x"), time.Millisecond), // 1 is now the most recent
		flowItem(3, "TCP", "start", v4, 2*time.Millisecond),                  // forgets 2
		payloadItem(2, observe.DirToEndpoint, []byte("lost"), 3*time.Millisecond),
	} {
		if err := w.WriteItem(it); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if st := w.Stats(); st.EvictedFlows != 1 || st.UnmatchedPayloadBytes != 4 {
		t.Errorf("stats %+v: want 1 evicted flow and its 4 later bytes unmatched", st)
	}
}

// TestPendingBound: payload waiting for its flow is kept up to PendingBytes (each piece also
// counting pendingItemCost); a piece beyond is dropped and counted at once, the rest at Close.
func TestPendingBound(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf, Options{PendingBytes: 2*pendingItemCost + 150})
	for _, it := range []*observe.Item{
		payloadItem(9, observe.DirToEndpoint, make([]byte, 100), 0),
		payloadItem(9, observe.DirToEndpoint, make([]byte, 60), 0), // 100+60 > 150: dropped
		payloadItem(8, observe.DirToEndpoint, make([]byte, 50), 0), // fits
	} {
		if err := w.WriteItem(it); err != nil {
			t.Fatal(err)
		}
	}
	if got := w.Stats().UnmatchedPayloadBytes; got != 60 {
		t.Errorf("before Close, UnmatchedPayloadBytes = %d, want 60", got)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if got := w.Stats().UnmatchedPayloadBytes; got != 210 {
		t.Errorf("after Close, UnmatchedPayloadBytes = %d, want 210", got)
	}
}

// TestPayloadAfterItsFlowsEnd: payload that comes after its flow's End is dropped and counted
// at once (it cannot follow the FIN), not kept waiting for a flow that will not come again.
func TestPayloadAfterItsFlowsEnd(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf, Options{})
	for _, it := range []*observe.Item{
		flowItem(1, "TCP", "start", v4, 0),
		endItem(1, "TCP", "client-closed", "forwarded", v4, time.Millisecond),
		payloadItem(1, observe.DirToClient, []byte("late"), 2*time.Millisecond),
	} {
		if err := w.WriteItem(it); err != nil {
			t.Fatal(err)
		}
	}
	if got := w.Stats().UnmatchedPayloadBytes; got != 4 {
		t.Errorf("UnmatchedPayloadBytes = %d, want 4", got)
	}
	if w.pendingBytes != 0 {
		t.Errorf("%d bytes waiting", w.pendingBytes)
	}
}

// TestUDPPastTheFlowCap: a datagram over MaxFlowBytes is cut to what is left, and one wholly
// past it (the cap reached exactly by the ones before) is not written: no empty datagram stands
// in for it.
func TestUDPPastTheFlowCap(t *testing.T) {
	for _, tc := range []struct {
		limit int64
		want  []int // the datagrams' sizes, on the client's leg then the pod's
	}{
		{150, []int{100, 100, 50, 50}},
		{200, []int{100, 100, 100, 100}},
	} {
		t.Run(fmt.Sprint(tc.limit), func(t *testing.T) {
			var buf bytes.Buffer
			w := NewWriter(&buf, Options{MaxFlowBytes: tc.limit})
			for _, it := range []*observe.Item{
				flowItem(1, "UDP", "start", v4, 0),
				payloadItem(1, observe.DirToEndpoint, make([]byte, 100), time.Millisecond),
				payloadItem(1, observe.DirToClient, make([]byte, 100), 2*time.Millisecond),
				payloadItem(1, observe.DirToEndpoint, make([]byte, 100), 3*time.Millisecond),
			} {
				if err := w.WriteItem(it); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			var sizes []int
			for _, b := range readBlocks(t, buf.Bytes())[2:] {
				sizes = append(sizes, int(binary.LittleEndian.Uint32(b.body[12:]))-ipv4HeaderLen-udpHeaderLen)
			}
			if !slices.Equal(sizes, tc.want) {
				t.Errorf("datagram sizes %v, want %v", sizes, tc.want)
			}
			if st := w.Stats(); st.TruncatedFlows != 1 {
				t.Errorf("TruncatedFlows = %d, want 1", st.TruncatedFlows)
			}
		})
	}
}
