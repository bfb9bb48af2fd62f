package pcap

// side is one end of a leg. A is the side that connects (the client on the client's leg, the
// proxy's source socket on the pod's leg), B the side that accepts (the service address, the
// endpoint).
type side uint8

const (
	sideA side = iota
	sideB
)

func (s side) other() side { return 1 - s }

// maxUnacked bounds the bytes a side sends before the receiver's ACK: half the advertised window,
// so no segment lies beyond the window tshark tracks.
const maxUnacked = window / 2

// emitFunc takes one synthesized packet and the comment to attach to it ("" for none).
type emitFunc func(pkt []byte, comment string)

// tcpLeg is one synthesized TCP connection: it numbers the segments both sides send so that a
// reader reassembles each direction to exactly the bytes given to send. Sequence numbers are
// uint32 and wrap, as TCP's do.
type tcpLeg struct {
	dir     [2]endpoints // dir[s]: the addresses of a packet side s sends
	isn     [2]uint32
	next    [2]uint32 // the sequence number of the next byte (or FIN) side s sends
	unacked [2]int    // bytes side s sent since the other side last sent a segment
	id      [2]uint16 // the IPv4 identification of side s's next packet
	mss     int
	done    bool // FIN exchange or RST written: nothing more is sent
}

// newTCPLeg is a leg from a (side A) to b (side B) whose sides start at the given initial
// sequence numbers. It sends nothing until handshake.
func newTCPLeg(e endpoints, isnA, isnB uint32) *tcpLeg {
	l := &tcpLeg{dir: [2]endpoints{e, e.reverse()}, isn: [2]uint32{isnA, isnB}, mss: 1460}
	if e.src.Addr().Is6() {
		l.mss = 1440 // a 1500-byte MTU less the 40-byte IPv6 header and the TCP header
	}
	l.next = l.isn
	l.id = [2]uint16{uint16(isnA), uint16(isnB)}
	return l
}

// segment writes one segment from s carrying the current acknowledgement of the other side.
func (l *tcpLeg) segment(s side, flags uint8, data []byte, comment string, emit emitFunc) {
	seg := tcpSegment{seq: l.next[s], ack: l.next[s.other()], flags: flags | flagACK, data: data}
	if flags&flagSYN != 0 {
		seg.mss = uint16(l.mss)
		if s == sideA { // the first SYN acknowledges nothing
			seg.flags &^= flagACK
			seg.ack = 0
		}
	}
	emit(buildTCP(l.dir[s], l.id[s], seg), comment)
	l.id[s]++
	l.next[s] += uint32(len(data))
	if flags&(flagSYN|flagFIN) != 0 {
		l.next[s]++ // SYN and FIN each take one sequence number
	}
	l.unacked[s] += len(data)
	l.unacked[s.other()] = 0 // this segment acknowledged everything the other side sent
}

// handshake writes SYN, SYN-ACK, ACK; comment goes on the SYN.
func (l *tcpLeg) handshake(comment string, emit emitFunc) {
	l.segment(sideA, flagSYN, nil, comment, emit)
	l.segment(sideB, flagSYN, nil, "", emit)
	l.segment(sideA, 0, nil, "", emit)
}

// send writes data from s in segments of at most one MSS, PSH on the last; comment goes on the
// last. The receiver acknowledges every maxUnacked bytes and at the end, as a receiving kernel
// would, so the window never fills.
func (l *tcpLeg) send(s side, data []byte, comment string, emit emitFunc) {
	if l.done {
		return
	}
	for len(data) > 0 {
		n := min(len(data), l.mss)
		var flags uint8
		c := ""
		if n == len(data) {
			flags, c = flagPSH, comment
		}
		l.segment(s, flags, data[:n], c, emit)
		data = data[n:]
		if len(data) == 0 || l.unacked[s] >= maxUnacked {
			l.segment(s.other(), 0, nil, "", emit)
		}
	}
}

// finish writes the orderly close that s starts: s's FIN, the other side's FIN, s's last ACK;
// comment goes on the first FIN.
func (l *tcpLeg) finish(s side, comment string, emit emitFunc) {
	if l.done {
		return
	}
	l.segment(s, flagFIN, nil, comment, emit)
	l.segment(s.other(), flagFIN, nil, "", emit)
	l.segment(s, 0, nil, "", emit)
	l.done = true
}

// reset writes s's RST (with ACK, as a kernel resetting an established connection sends it).
func (l *tcpLeg) reset(s side, comment string, emit emitFunc) {
	if l.done {
		return
	}
	l.segment(s, flagRST, nil, comment, emit)
	l.done = true
}
