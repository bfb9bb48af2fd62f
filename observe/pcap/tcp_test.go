package pcap

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// seg is what the tests read back from a synthesized TCP packet.
type seg struct {
	From     string // "A" or "B"
	Seq, Ack uint32
	Flags    string
	Len      int
}

func flagNames(f uint8) string {
	s := ""
	for _, n := range []struct {
		bit  uint8
		name string
	}{{flagSYN, "S"}, {flagFIN, "F"}, {flagRST, "R"}, {flagPSH, "P"}, {flagACK, "."}} {
		if f&n.bit != 0 {
			s += n.name
		}
	}
	return s
}

// parseTCP reads back a packet buildTCP wrote, checking its lengths and checksums on the way.
func parseTCP(t *testing.T, e endpoints, pkt []byte) seg {
	t.Helper()
	ipl := ipHeaderLen(e.src.Addr().Is6())
	if e.src.Addr().Is4() {
		if got := int(binary.BigEndian.Uint16(pkt[2:])); got != len(pkt) {
			t.Fatalf("IPv4 total length %d, packet %d", got, len(pkt))
		}
		if fold(sum(0, pkt[:ipv4HeaderLen])) != 0xffff {
			t.Fatalf("IPv4 header checksum wrong: % x", pkt[:ipv4HeaderLen])
		}
	} else if got := int(binary.BigEndian.Uint16(pkt[4:])); got != len(pkt)-ipv6HeaderLen {
		t.Fatalf("IPv6 payload length %d, packet %d", got, len(pkt))
	}
	tcp := pkt[ipl:]
	// The checksum over the pseudo-header and the segment, its checksum field included, is all
	// ones when right: transportChecksum returns its complement, 0.
	if c := transportChecksum(e, protoTCP, tcp); c != 0 {
		t.Fatalf("TCP checksum wrong (residue %#x)", c)
	}
	hl := int(tcp[12]>>4) * 4
	return seg{Seq: binary.BigEndian.Uint32(tcp[4:]), Ack: binary.BigEndian.Uint32(tcp[8:]), Flags: flagNames(tcp[13]), Len: len(tcp) - hl}
}

// record collects a leg's packets, read back.
func record(t *testing.T, l *tcpLeg) (*[]seg, emitFunc) {
	var out []seg
	return &out, func(pkt []byte, comment string) {
		from, e := "A", l.dir[sideA]
		if a, _ := netip.AddrFromSlice(pkt[12:16]); pkt[0]>>4 == 4 && a != e.src.Addr() {
			from, e = "B", l.dir[sideB]
		}
		s := parseTCP(t, e, pkt)
		s.From = from
		out = append(out, s)
	}
}

// TestLegSequenceNumbers: the numbers of a whole connection whose initial sequence numbers wrap
// during it: SYN and FIN take one number each, data its length, every segment acknowledges all
// the other side sent, data splits at the MSS with PSH on the last piece, and the receiver
// acknowledges each piece.
func TestLegSequenceNumbers(t *testing.T) {
	e, _ := legAddrs(netip.MustParseAddrPort("10.0.0.1:40000"), netip.MustParseAddrPort("10.96.0.10:80"))
	const isnA, isnB = 0xfffffffe, 0xffffff00
	l := newTCPLeg(e, isnA, isnB)
	got, emit := record(t, l)
	l.handshake("", emit)
	l.send(sideA, make([]byte, 3000), "", emit)
	l.send(sideB, make([]byte, 300), "", emit)
	l.finish(sideB, "", emit)
	l.send(sideA, []byte("after the close"), "", emit) // ignored: the leg is done
	a := uint32(isnA + 1)                              // 0xffffffff
	b := uint32(isnB + 1)
	want := []seg{
		{"A", isnA, 0, "S", 0},
		{"B", isnB, a, "S.", 0},
		{"A", a, b, ".", 0},
		{"A", a, b, ".", 1460},
		{"A", a + 1460, b, ".", 1460}, // wrapped: 1459
		{"A", a + 2920, b, "P.", 80},
		{"B", b, a + 3000, ".", 0},
		{"B", b, a + 3000, "P.", 300}, // b+300 wraps
		{"A", a + 3000, b + 300, ".", 0},
		{"B", b + 300, a + 3000, "F.", 0},
		{"A", a + 3000, b + 301, "F.", 0},
		{"B", b + 301, a + 3001, ".", 0},
	}
	if diff := cmp.Diff(want, *got); diff != "" {
		t.Errorf("segments (-want +got):\n%s", diff)
	}
	if a+1460 != 1459 {
		t.Fatalf("the test's numbers do not wrap")
	}
}

// TestLegAcknowledgesWithinTheWindow: a long send is acknowledged before a window's worth is
// outstanding, IPv6 segments are 1440 bytes, and a reset ends the leg with one RST.
func TestLegAcknowledgesWithinTheWindow(t *testing.T) {
	e, _ := legAddrs(netip.MustParseAddrPort("[fd00::2]:51000"), netip.MustParseAddrPort("[fd00:1::5]:8080"))
	l := newTCPLeg(e, 1000, 2000)
	var segs []seg
	emit := func(pkt []byte, _ string) {
		from, d := "A", l.dir[sideA]
		if binary.BigEndian.Uint16(pkt[ipv6HeaderLen:]) == e.dst.Port() {
			from, d = "B", l.dir[sideB]
		}
		s := parseTCP(t, d, pkt)
		s.From = from
		segs = append(segs, s)
	}
	l.handshake("", emit)
	segs = nil
	l.send(sideB, make([]byte, 200000), "", emit)
	acked, sent := uint32(2001), uint32(2001)
	for _, s := range segs {
		switch s.From {
		case "B":
			if s.Len > 1440 {
				t.Fatalf("segment of %d bytes, want at most the IPv6 MSS 1440", s.Len)
			}
			sent = s.Seq + uint32(s.Len)
			if sent-acked > window {
				t.Fatalf("%d bytes outstanding, beyond the window %d", sent-acked, window)
			}
		case "A":
			acked = s.Ack
		}
	}
	if acked != 2001+200000 {
		t.Errorf("the receiver's last ACK is %d, want %d", acked, 2001+200000)
	}
	segs = nil
	l.reset(sideA, "", emit)
	l.finish(sideA, "", emit)
	if want := []seg{{"A", 1001, 2001 + 200000, "R.", 0}}; !cmp.Equal(want, segs) {
		t.Errorf("reset then finish: %v, want %v", segs, want)
	}
}

// TestChecksumOddLength: an odd-length payload pads its last byte for the checksum, and UDP
// and TCP over both families verify.
func TestChecksumOddLength(t *testing.T) {
	for _, pair := range [][2]string{{"10.0.0.1:53", "10.96.0.10:53"}, {"[fd00::1]:53", "[fd00:96::10]:53"}} {
		e, _ := legAddrs(netip.MustParseAddrPort(pair[0]), netip.MustParseAddrPort(pair[1]))
		for n := range 4 {
			data := []byte("abc")[:n]
			pkt := buildUDP(e, 7, data)
			u := pkt[ipHeaderLen(e.src.Addr().Is6()):]
			if c := transportChecksum(e, protoUDP, u); c != 0 {
				t.Errorf("%s, %d bytes: UDP checksum residue %#x", pair[0], n, c)
			}
			parseTCP(t, e, buildTCP(e, 7, tcpSegment{seq: 1, ack: 2, flags: flagACK, data: data}))
		}
	}
}

// TestLegAddrsMixedFamilies: a dual-stack socket's IPv4-mapped address is unmapped, and a leg
// whose sides are still of two families is written in IPv6.
func TestLegAddrsMixedFamilies(t *testing.T) {
	for _, tc := range []struct{ a, b, wantSrc, wantDst string }{
		{"[::ffff:10.0.0.1]:1", "10.96.0.10:80", "10.0.0.1:1", "10.96.0.10:80"},
		{"10.0.0.1:1", "[fd00::5]:80", "[::ffff:10.0.0.1]:1", "[fd00::5]:80"},
	} {
		e, ok := legAddrs(netip.MustParseAddrPort(tc.a), netip.MustParseAddrPort(tc.b))
		if !ok || e.src.String() != tc.wantSrc || e.dst.String() != tc.wantDst {
			t.Errorf("legAddrs(%s, %s) = %s, %s, %v; want %s, %s", tc.a, tc.b, e.src, e.dst, ok, tc.wantSrc, tc.wantDst)
		}
	}
	if _, ok := legAddrs(netip.AddrPort{}, netip.MustParseAddrPort("10.96.0.10:80")); ok {
		t.Errorf("a leg with a missing address opened")
	}
}

// TestEndOf: who closes a TCP flow, and how, for each end reason.
func TestEndOf(t *testing.T) {
	for _, tc := range []struct {
		reason, verdict string
		origin          origin
		rst             bool
	}{
		{"client-closed", "forwarded", fromClient, false},
		{"endpoint-closed", "forwarded", fromEndpoint, false},
		{"client-reset", "reset", fromClient, true},
		{"endpoint-reset", "reset", fromEndpoint, true},
		{"idle-timeout", "timeout", fromProxy, false},
		{"shutdown", "closed", fromProxy, true},
		{"no-endpoints", "refused", fromProxy, true},
		{"a-future-reason", "reset", fromProxy, true},
		{"a-future-reason", "forwarded", fromProxy, false},
	} {
		o, rst := endOf(tc.reason, tc.verdict)
		if o != tc.origin || rst != tc.rst {
			t.Errorf("endOf(%s, %s) = %d, %v; want %d, %v", tc.reason, tc.verdict, o, rst, tc.origin, tc.rst)
		}
	}
}

// TestUDPChecksumZeroIsSentAsOnes: a datagram whose checksum computes to 0 carries 0xffff
// instead (RFC 768: 0 would say "no checksum"), which still verifies.
func TestUDPChecksumZeroIsSentAsOnes(t *testing.T) {
	e, _ := legAddrs(netip.MustParseAddrPort("10.0.0.1:53"), netip.MustParseAddrPort("10.96.0.10:53"))
	// With two payload bytes equal to the checksum of the datagram with two zero bytes, the sum
	// becomes all ones: the computed checksum is 0.
	zero := buildUDP(e, 1, []byte{0, 0})
	c := binary.BigEndian.Uint16(zero[ipv4HeaderLen+6:])
	pkt := buildUDP(e, 1, []byte{byte(c >> 8), byte(c)})
	u := pkt[ipv4HeaderLen:]
	if got := binary.BigEndian.Uint16(u[6:]); got != 0xffff {
		t.Errorf("checksum field %#04x, want 0xffff", got)
	}
	if r := transportChecksum(e, protoUDP, u); r != 0 {
		t.Errorf("checksum residue %#x, want 0", r)
	}
}
