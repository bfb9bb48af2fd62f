package pcap

import (
	"encoding/binary"
	"net/netip"
)

// The IP protocol numbers the synthesized packets carry.
const (
	protoTCP = 6
	protoUDP = 17
)

// The TCP flags the legs use.
const (
	flagFIN = 0x01
	flagSYN = 0x02
	flagRST = 0x04
	flagPSH = 0x08
	flagACK = 0x10
)

const (
	ipv4HeaderLen = 20
	ipv6HeaderLen = 40
	tcpHeaderLen  = 20
	udpHeaderLen  = 8
	// mssOptionLen is the TCP MSS option a SYN carries, so tshark (and a reader) see the segment
	// size the legs split data at.
	mssOptionLen = 4
	// window is every segment's advertised window: the legs never send more than this unacked
	// (see maxUnacked), so tshark's analysis finds no "window full".
	window = 65535
	ttl    = 64
)

// maxIPPayload is the most a packet of the family can carry after its IP header: the 16-bit
// total length (IPv4) or payload length (IPv6).
func maxIPPayload(is6 bool) int {
	if is6 {
		return 0xffff
	}
	return 0xffff - ipv4HeaderLen
}

// ipHeaderLen is the header length of the family.
func ipHeaderLen(is6 bool) int {
	if is6 {
		return ipv6HeaderLen
	}
	return ipv4HeaderLen
}

// endpoints is one direction of a leg: who sends to whom. Both addresses are of one family
// (legAddrs makes them so).
type endpoints struct {
	src, dst netip.AddrPort
}

func (e endpoints) reverse() endpoints { return endpoints{src: e.dst, dst: e.src} }

// legAddrs returns a leg's two addresses in one family: IPv4-mapped IPv6 addresses (a
// dual-stack socket's view of an IPv4 peer) are unmapped, and if one side is still IPv6 the other
// is mapped into IPv6, so the packet has one IP header that names both. ok is false when either
// address is missing.
func legAddrs(a, b netip.AddrPort) (endpoints, bool) {
	if !a.IsValid() || !b.IsValid() {
		return endpoints{}, false
	}
	a = netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
	b = netip.AddrPortFrom(b.Addr().Unmap(), b.Port())
	if a.Addr().Is4() != b.Addr().Is4() {
		a = netip.AddrPortFrom(netip.AddrFrom16(a.Addr().As16()), a.Port())
		b = netip.AddrPortFrom(netip.AddrFrom16(b.Addr().As16()), b.Port())
	}
	return endpoints{src: a, dst: b}, true
}

// tcpSegment is one TCP segment to synthesize.
type tcpSegment struct {
	seq, ack uint32
	flags    uint8
	mss      uint16 // the MSS option's value, 0 for none (only SYNs carry it)
	data     []byte
}

// buildTCP returns an IP packet carrying seg from e.src to e.dst with correct IP and TCP
// checksums. id is the IPv4 identification (ignored for IPv6).
func buildTCP(e endpoints, id uint16, seg tcpSegment) []byte {
	hl := tcpHeaderLen
	if seg.mss != 0 {
		hl += mssOptionLen
	}
	is6 := e.src.Addr().Is6()
	ipl := ipHeaderLen(is6)
	pkt := make([]byte, ipl+hl+len(seg.data))
	t := pkt[ipl:]
	binary.BigEndian.PutUint16(t[0:], e.src.Port())
	binary.BigEndian.PutUint16(t[2:], e.dst.Port())
	binary.BigEndian.PutUint32(t[4:], seg.seq)
	binary.BigEndian.PutUint32(t[8:], seg.ack)
	t[12] = byte(hl/4) << 4
	t[13] = seg.flags
	binary.BigEndian.PutUint16(t[14:], window)
	if seg.mss != 0 {
		t[20], t[21] = 2, 4 // kind MSS, length 4
		binary.BigEndian.PutUint16(t[22:], seg.mss)
	}
	copy(t[hl:], seg.data)
	putIP(pkt, e, id, protoTCP, len(t))
	binary.BigEndian.PutUint16(t[16:], transportChecksum(e, protoTCP, t))
	return pkt
}

// buildUDP returns an IP packet carrying one datagram from e.src to e.dst with correct IP and
// UDP checksums. data must fit (maxIPPayload - udpHeaderLen).
func buildUDP(e endpoints, id uint16, data []byte) []byte {
	is6 := e.src.Addr().Is6()
	ipl := ipHeaderLen(is6)
	pkt := make([]byte, ipl+udpHeaderLen+len(data))
	u := pkt[ipl:]
	binary.BigEndian.PutUint16(u[0:], e.src.Port())
	binary.BigEndian.PutUint16(u[2:], e.dst.Port())
	binary.BigEndian.PutUint16(u[4:], uint16(len(u)))
	copy(u[udpHeaderLen:], data)
	putIP(pkt, e, id, protoUDP, len(u))
	c := transportChecksum(e, protoUDP, u)
	if c == 0 {
		c = 0xffff // RFC 768: a computed 0 is sent as all ones; 0 means "no checksum"
	}
	binary.BigEndian.PutUint16(u[6:], c)
	return pkt
}

// putIP writes the IP header at the start of pkt for a payload of n bytes.
func putIP(pkt []byte, e endpoints, id uint16, proto uint8, n int) {
	if e.src.Addr().Is6() {
		pkt[0] = 6 << 4
		binary.BigEndian.PutUint16(pkt[4:], uint16(n))
		pkt[6] = proto
		pkt[7] = ttl
		s, d := e.src.Addr().As16(), e.dst.Addr().As16()
		copy(pkt[8:], s[:])
		copy(pkt[24:], d[:])
		return
	}
	pkt[0] = 4<<4 | ipv4HeaderLen/4
	binary.BigEndian.PutUint16(pkt[2:], uint16(ipv4HeaderLen+n))
	binary.BigEndian.PutUint16(pkt[4:], id)
	pkt[6] = 0x40 // don't fragment
	pkt[8] = ttl
	pkt[9] = proto
	s, d := e.src.Addr().As4(), e.dst.Addr().As4()
	copy(pkt[12:], s[:])
	copy(pkt[16:], d[:])
	binary.BigEndian.PutUint16(pkt[10:], ^fold(sum(0, pkt[:ipv4HeaderLen])))
}

// transportChecksum is the TCP or UDP checksum of seg (its checksum field zero) with the
// pseudo-header of e's family (RFC 793, RFC 8200 section 8.1).
func transportChecksum(e endpoints, proto uint8, seg []byte) uint16 {
	var s uint32
	if e.src.Addr().Is6() {
		a, b := e.src.Addr().As16(), e.dst.Addr().As16()
		s = sum(s, a[:])
		s = sum(s, b[:])
		s += uint32(len(seg)>>16) + uint32(len(seg)&0xffff)
	} else {
		a, b := e.src.Addr().As4(), e.dst.Addr().As4()
		s = sum(s, a[:])
		s = sum(s, b[:])
		s += uint32(len(seg))
	}
	s += uint32(proto)
	return ^fold(sum(s, seg))
}

// sum adds b to the ones' complement sum s as 16-bit big-endian words, an odd last byte padded
// with zero. The partial sums of our packets (under 64 KiB) cannot overflow 32 bits.
func sum(s uint32, b []byte) uint32 {
	for len(b) >= 2 {
		s += uint32(b[0])<<8 | uint32(b[1])
		b = b[2:]
	}
	if len(b) == 1 {
		s += uint32(b[0]) << 8
	}
	return s
}

// fold folds the carries of s into 16 bits.
func fold(s uint32) uint16 {
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return uint16(s)
}
