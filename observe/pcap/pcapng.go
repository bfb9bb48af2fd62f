package pcap

import (
	"encoding/binary"
	"time"
)

// pcapng blocks (draft-ietf-opsawg-pcapng), written little-endian: the byte-order magic tells
// readers which order the section uses.
const (
	blockSHB = 0x0A0D0D0A
	blockIDB = 0x00000001
	blockEPB = 0x00000006

	byteOrderMagic = 0x1A2B3C4D

	optEnd      = 0
	optComment  = 1
	optUserAppl = 4 // shb_userappl
	optIfName   = 2 // if_name
	optTSResol  = 9 // if_tsresol

	// linkTypeRaw is LINKTYPE_RAW: each packet starts with its IPv4 or IPv6 header, the version
	// nibble says which. No link layer to invent (MAC addresses would be made up), and one
	// interface carries both families.
	linkTypeRaw = 101
	// snapLen is the interface's snapshot length: no packet we write is cut.
	snapLen = 0x40000

	// appName is the shb_userappl and if_name of the file.
	appName = "kube-portal-proxy"
)

// option is a pcapng option: its code and value.
type option struct {
	code  uint16
	value []byte
}

// pad4 rounds n up to a multiple of 4: pcapng pads every body and option value to 32 bits.
func pad4(n int) int { return (n + 3) &^ 3 }

func optionsLen(opts []option) int {
	if len(opts) == 0 {
		return 0
	}
	n := 4 // opt_endofopt
	for _, o := range opts {
		n += 4 + pad4(len(o.value))
	}
	return n
}

// putOptions writes opts and the end-of-options marker at b, which is optionsLen(opts) long
// and zeroed.
func putOptions(b []byte, opts []option) {
	if len(opts) == 0 {
		return
	}
	for _, o := range opts {
		binary.LittleEndian.PutUint16(b[0:], o.code)
		binary.LittleEndian.PutUint16(b[2:], uint16(len(o.value)))
		copy(b[4:], o.value)
		b = b[4+pad4(len(o.value)):]
	}
	binary.LittleEndian.PutUint16(b[0:], optEnd)
	binary.LittleEndian.PutUint16(b[2:], 0)
}

// block frames a body of n bytes followed by opts: type, total length, body, options, total
// length again. fill writes the body into the slice it is given.
func block(typ uint32, n int, opts []option, fill func(body []byte)) []byte {
	total := 12 + pad4(n) + optionsLen(opts)
	b := make([]byte, total)
	binary.LittleEndian.PutUint32(b[0:], typ)
	binary.LittleEndian.PutUint32(b[4:], uint32(total))
	fill(b[8 : 8+n])
	putOptions(b[8+pad4(n):total-4], opts)
	binary.LittleEndian.PutUint32(b[total-4:], uint32(total))
	return b
}

// sectionHeader is the file's Section Header Block, with an unknown section length (-1): the
// file is written as a stream.
func sectionHeader() []byte {
	return block(blockSHB, 16, []option{{optUserAppl, []byte(appName)}}, func(b []byte) {
		binary.LittleEndian.PutUint32(b[0:], byteOrderMagic)
		binary.LittleEndian.PutUint16(b[4:], 1) // major version
		binary.LittleEndian.PutUint16(b[6:], 0) // minor version
		binary.LittleEndian.PutUint64(b[8:], ^uint64(0))
	})
}

// interfaceDescription is the one Interface Description Block: raw IP, microsecond timestamps
// (if_tsresol 6, pcapng's default, said anyway for readers that look).
func interfaceDescription() []byte {
	opts := []option{{optIfName, []byte(appName)}, {optTSResol, []byte{6}}}
	return block(blockIDB, 8, opts, func(b []byte) {
		binary.LittleEndian.PutUint16(b[0:], linkTypeRaw)
		binary.LittleEndian.PutUint32(b[4:], snapLen)
	})
}

// enhancedPacket is an Enhanced Packet Block for pkt on interface 0 at t (microseconds since the
// epoch), with a comment when comment is not empty.
func enhancedPacket(t time.Time, pkt []byte, comment string) []byte {
	var opts []option
	if comment != "" {
		if len(comment) > 0xffff { // an option's length is 16 bits
			comment = comment[:0xffff]
		}
		opts = []option{{optComment, []byte(comment)}}
	}
	us := uint64(t.UnixMicro())
	return block(blockEPB, 20+len(pkt), opts, func(b []byte) {
		binary.LittleEndian.PutUint32(b[0:], 0) // interface ID
		binary.LittleEndian.PutUint32(b[4:], uint32(us>>32))
		binary.LittleEndian.PutUint32(b[8:], uint32(us))
		binary.LittleEndian.PutUint32(b[12:], uint32(len(pkt)))
		binary.LittleEndian.PutUint32(b[16:], uint32(len(pkt)))
		copy(b[20:], pkt)
	})
}
