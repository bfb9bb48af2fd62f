// Package snapshot keeps a compact record of what the proxy serves (per service port: its proxy
// port, balancer settings and the endpoints each class of traffic uses) in a file, so that a
// process restarted after a SIGKILL or a crash can serve the connections its reopened sockets
// hold before it has read a single Service or EndpointSlice. The file is binary (10,000 ports
// with 50,000 endpoints decode in milliseconds, not the seconds a full list takes), versioned,
// checksummed, and tied to the node that wrote it: anything else is rejected whole.
package snapshot

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"iter"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/atomicfile"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Version is the version of the file's format. A file of another version is ignored. Version 2
// added each port's last activity (Port.LastActive).
const Version = 2

// magic starts every snapshot file.
const magic = "KPPSNAP\n"

// Errors a read wraps: the file is damaged or not a snapshot (ErrCorrupt), of another format
// version (ErrVersion), or written on another node (ErrOtherNode). Each means: start without it.
var (
	ErrCorrupt   = errors.New("restart snapshot unreadable")
	ErrVersion   = errors.New("restart snapshot of another format version")
	ErrOtherNode = errors.New("restart snapshot written on another node")
)

// State is what the proxy served when the snapshot was taken.
type State struct {
	// Node is the node name of the writer (--hostname-override).
	Node string
	// Written is when the snapshot was taken.
	Written time.Time
	Ports   []Port
}

// Port is one service port as the proxy served it.
type Port struct {
	Name     service.ServicePortName
	Protocol service.Protocol
	// ProxyPort is where the portal rules send the port's cluster traffic (iptables mode) or
	// the service port (bind mode); ExternalProxyPort, when not 0, its external traffic's.
	ProxyPort, ExternalProxyPort uint16
	Affinity                     service.Affinity
	Balancing                    service.Balancing
	// Internal are the endpoints the port's cluster traffic used (all of its traffic when not
	// Split); External, when Split, those of its external traffic (a Local traffic policy).
	Internal, External []Endpoint
	Split              bool
	// LastActive is when the port last carried traffic (a connection accepted, a UDP session
	// created, or one still open), to the second; zero: none seen. A restart reopens the ports
	// used most recently first: those are the ones whose clients are refused meanwhile.
	LastActive time.Time
}

// Endpoint is one endpoint a class of traffic used, with its conditions.
type Endpoint struct {
	Addr                        netip.AddrPort
	Ready, Serving, Terminating bool
}

// Addrs lists the endpoints' addresses, in order.
func Addrs(eps []Endpoint) []netip.AddrPort {
	out := make([]netip.AddrPort, len(eps))
	for i, e := range eps {
		out[i] = e.Addr
	}
	return out
}

// Write replaces the file at path with st: a temporary file in the same directory (mode 0600),
// then a rename, so a reader (or a writer killed halfway) finds the old snapshot or the new one,
// never half of one. There is no fsync: a node that crashes hard enough to lose the data also
// loses the portal rules the snapshot serves behind.
func Write(path string, st *State) error {
	return WritePorts(path, st.Node, st.Written, statePorts(st))
}

// WritePorts is Write of the ports that ports yields, encoded one by one into the file, so that
// a snapshot of 10,000 ports is never whole in memory. A yielded Port is read only during the
// yield (the caller may reuse it).
func WritePorts(path, node string, written time.Time, ports iter.Seq[*Port]) error {
	if err := atomicfile.Write(path, tempPrefix(path), func(w io.Writer) error { return encodeTo(w, node, written, ports) }); err != nil {
		return fmt.Errorf("restart snapshot %s: %w", path, err)
	}
	return nil
}

func statePorts(st *State) iter.Seq[*Port] {
	return func(yield func(*Port) bool) {
		for i := range st.Ports {
			if !yield(&st.Ports[i]) {
				return
			}
		}
	}
}

// RemoveStale removes the temporary files a writer killed between creating one and renaming it
// left beside path (a crash loop would otherwise pile them up in the state directory). Call it
// before the first Write of a process; it reports what it could not remove.
func RemoveStale(path string) error {
	stale, err := filepath.Glob(filepath.Join(filepath.Dir(path), tempPrefix(path)+"*"))
	if err != nil {
		return fmt.Errorf("restart snapshot %s: %w", path, err)
	}
	var errs []error
	for _, f := range stale {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// tempPrefix is how the temporary files of a write of path start.
func tempPrefix(path string) string { return "." + filepath.Base(path) + ".tmp." }

// Read reads the snapshot at path, written on node. A missing file is no state and no error. A
// file that does not decode, or of another version or node, is an error wrapping ErrCorrupt,
// ErrVersion or ErrOtherNode, and no state.
func Read(path, node string) (*State, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("restart snapshot %s: %w", path, err)
	}
	st, err := Decode(data)
	if err == nil && st.Node != node {
		st, err = nil, fmt.Errorf("%w: %q, this is %q", ErrOtherNode, st.Node, node)
	}
	if err != nil {
		return nil, fmt.Errorf("restart snapshot %s: %w", path, err)
	}
	return st, nil
}

// The format, after the magic: uvarint version, then the body, then the CRC-32C of everything
// before it (4 bytes, big-endian). Body: string node, varint unix nanoseconds, the ports, then a
// 0 byte (an empty namespace: no port has one). Each port: strings namespace, name, port name; a
// protocol byte; uvarint proxy port and external proxy port; a flags byte (client-IP affinity,
// split); uvarint affinity timeout; string algorithm; uvarint consecutive failures, ejection
// time, max ejection percent, slow start; uvarint unix seconds of the last activity (0: none;
// since version 2); then the internal and the external endpoint lists: uvarint count, then each
// endpoint: a byte 4 or 16, the address, big-endian uint16 port, a conditions byte. Strings are a
// uvarint length and the bytes; durations are nanoseconds. The end marker rather than a count up
// front lets the writer stream ports it has not counted.

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// Encode serialises st.
func Encode(st *State) []byte {
	var buf bytes.Buffer
	_ = encodeTo(&buf, st.Node, st.Written, statePorts(st)) // a bytes.Buffer does not fail
	return buf.Bytes()
}

// encodeTo writes the snapshot of ports to w, through one buffer of 64 KiB and one port's bytes.
func encodeTo(w io.Writer, node string, written time.Time, ports iter.Seq[*Port]) error {
	sum := crc32.New(crcTable)
	bw := bufio.NewWriterSize(io.MultiWriter(w, sum), 64<<10)
	b := make([]byte, 0, 512)
	b = append(b, magic...)
	b = binary.AppendUvarint(b, Version)
	b = appendString(b, node)
	b = binary.AppendVarint(b, written.UnixNano())
	_, _ = bw.Write(b) // a bufio.Writer's error is returned by Flush
	for p := range ports {
		b = appendPort(b[:0], p)
		_, _ = bw.Write(b)
	}
	_ = bw.WriteByte(0)
	if err := bw.Flush(); err != nil {
		return err
	}
	_, err := w.Write(binary.BigEndian.AppendUint32(nil, sum.Sum32()))
	return err
}

func appendPort(b []byte, p *Port) []byte {
	b = appendString(b, p.Name.Namespace)
	b = appendString(b, p.Name.Name)
	b = appendString(b, p.Name.Port)
	b = append(b, protocolByte(p.Protocol))
	b = binary.AppendUvarint(b, uint64(p.ProxyPort))
	b = binary.AppendUvarint(b, uint64(p.ExternalProxyPort))
	var flags byte
	if p.Affinity.ClientIP {
		flags |= 1
	}
	if p.Split {
		flags |= 2
	}
	b = append(b, flags)
	b = binary.AppendUvarint(b, uint64(max(p.Affinity.Timeout, 0)))
	b = appendString(b, string(p.Balancing.Algorithm))
	o := p.Balancing.Outlier
	b = binary.AppendUvarint(b, uint64(max(o.ConsecutiveFailures, 0)))
	b = binary.AppendUvarint(b, uint64(max(o.EjectionTime, 0)))
	b = binary.AppendUvarint(b, uint64(max(o.MaxEjectionPercent, 0)))
	b = binary.AppendUvarint(b, uint64(max(p.Balancing.SlowStart, 0)))
	var active int64
	if !p.LastActive.IsZero() {
		active = max(p.LastActive.Unix(), 0)
	}
	b = binary.AppendUvarint(b, uint64(active))
	b = appendEndpoints(b, p.Internal)
	return appendEndpoints(b, p.External)
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendEndpoints(b []byte, eps []Endpoint) []byte {
	b = binary.AppendUvarint(b, uint64(len(eps)))
	for _, e := range eps {
		a := e.Addr.Addr().Unmap()
		if a.Is4() {
			a4 := a.As4()
			b = append(b, 4)
			b = append(b, a4[:]...)
		} else {
			a16 := a.As16()
			b = append(b, 16)
			b = append(b, a16[:]...)
		}
		b = binary.BigEndian.AppendUint16(b, e.Addr.Port())
		var c byte
		if e.Ready {
			c |= 1
		}
		if e.Serving {
			c |= 2
		}
		if e.Terminating {
			c |= 4
		}
		b = append(b, c)
	}
	return b
}

func protocolByte(p service.Protocol) byte {
	switch p {
	case service.TCP:
		return 1
	case service.UDP:
		return 2
	}
	return 0
}

// Decode parses a snapshot. Anything the restart could not use as it is (a bad checksum, a
// truncated or overlong file, an unknown protocol, an empty name, a name listed twice, an invalid
// endpoint, a setting out of range) rejects the whole file.
func Decode(data []byte) (*State, error) {
	if len(data) < len(magic)+4 || string(data[:len(magic)]) != magic {
		return nil, fmt.Errorf("%w: not a snapshot", ErrCorrupt)
	}
	body, sum := data[:len(data)-4], binary.BigEndian.Uint32(data[len(data)-4:])
	// The framing (magic, version, checksum) is the same in every version, so a damaged file
	// is told from a file of another version.
	if crc32.Checksum(body, crcTable) != sum {
		return nil, fmt.Errorf("%w: checksum mismatch", ErrCorrupt)
	}
	d := decoder{b: body[len(magic):]}
	if v := d.uvarint(); d.err == nil && v != Version {
		return nil, fmt.Errorf("%w: %d, this proxy reads %d", ErrVersion, v, Version)
	}
	st := &State{Node: d.string()}
	st.Written = time.Unix(0, d.varint())
	// A port of five IPv4 endpoints takes about 70 bytes: room for the file's ports at once,
	// and no allocation larger than the file allows.
	st.Ports = make([]Port, 0, len(d.b)/64)
	seen := make(map[service.ServicePortName]bool, len(d.b)/64)
	for d.err == nil {
		if len(d.b) > 0 && d.b[0] == 0 { // the end marker
			d.b = d.b[1:]
			break
		}
		p := d.port()
		if d.err != nil {
			break
		}
		if seen[p.Name] {
			d.fail("service port %s listed twice", p.Name)
			break
		}
		seen[p.Name] = true
		st.Ports = append(st.Ports, p)
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d bytes after the last port", len(d.b))
	}
	if d.err != nil {
		return nil, d.err
	}
	return st, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...)
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if !d.number(n) {
		return 0
	}
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if !d.number(n) {
		return 0
	}
	return v
}

// number consumes the n bytes of a varint that binary.Uvarint or binary.Varint read. A number
// written longer than it needs (a last byte of 0 after continuation bytes) is rejected, as the
// writer never writes one: the file is then the one encoding of its state, which is what
// "anything else is rejected whole" means (FuzzDecodeBody found 60 written as 0xbc 0x00).
func (d *decoder) number(n int) bool {
	if n <= 0 {
		d.fail("truncated number")
		return false
	}
	if n > 1 && d.b[n-1] == 0 {
		d.fail("number not in its shortest form")
		return false
	}
	d.b = d.b[n:]
	return true
}

func (d *decoder) bytes(n uint64) []byte {
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.fail("truncated")
		return nil
	}
	out := d.b[:n]
	d.b = d.b[n:]
	return out
}

func (d *decoder) byte() byte {
	b := d.bytes(1)
	if b == nil {
		return 0
	}
	return b[0]
}

func (d *decoder) string() string {
	n := d.uvarint()
	if n > 1024 {
		d.fail("string of %d bytes", n)
		return ""
	}
	return string(d.bytes(n))
}

// bounded reads a uvarint no larger than limit.
func (d *decoder) bounded(what string, limit uint64) uint64 {
	v := d.uvarint()
	if v > limit {
		d.fail("%s %d out of range", what, v)
		return 0
	}
	return v
}

func (d *decoder) port() Port {
	var p Port
	p.Name = service.ServicePortName{Namespace: d.string(), Name: d.string(), Port: d.string()}
	switch d.byte() {
	case 1:
		p.Protocol = service.TCP
	case 2:
		p.Protocol = service.UDP
	default:
		d.fail("unknown protocol")
	}
	p.ProxyPort = uint16(d.bounded("proxy port", 65535))
	p.ExternalProxyPort = uint16(d.bounded("external proxy port", 65535))
	flags := d.byte()
	if flags&^3 != 0 {
		d.fail("unknown flags %#x", flags)
	}
	p.Affinity.ClientIP, p.Split = flags&1 != 0, flags&2 != 0
	const maxDuration = uint64(1<<63 - 1)
	p.Affinity.Timeout = time.Duration(d.bounded("affinity timeout", maxDuration))
	p.Balancing.Algorithm = service.Algorithm(d.string())
	switch p.Balancing.Algorithm {
	case "", service.RoundRobin, service.LeastConnections, service.RandomTwoChoices:
	default:
		d.fail("unknown algorithm %q", p.Balancing.Algorithm)
	}
	p.Balancing.Outlier.ConsecutiveFailures = int(d.bounded("consecutive failures", 1<<31-1))
	p.Balancing.Outlier.EjectionTime = time.Duration(d.bounded("ejection time", maxDuration))
	p.Balancing.Outlier.MaxEjectionPercent = int(d.bounded("max ejection percent", 100))
	p.Balancing.SlowStart = time.Duration(d.bounded("slow start", maxDuration))
	if active := d.bounded("last activity", 1<<40); active != 0 {
		p.LastActive = time.Unix(int64(active), 0)
	}
	p.Internal = d.endpoints()
	p.External = d.endpoints()
	if d.err == nil && (p.Name.Namespace == "" || p.Name.Name == "") {
		d.fail("service port without a name")
	}
	if d.err == nil && !p.Split && len(p.External) > 0 {
		d.fail("service port %s: external endpoints without a split", p.Name)
	}
	return p
}

func (d *decoder) endpoints() []Endpoint {
	n := d.uvarint()
	// Each endpoint takes at least 8 bytes.
	if d.err != nil || n > uint64(len(d.b))/8 {
		d.fail("endpoint count %d larger than the file", n)
		return nil
	}
	if n == 0 {
		return nil
	}
	out := make([]Endpoint, 0, n)
	for range n {
		var a netip.Addr
		switch l := d.byte(); l {
		case 4:
			b := d.bytes(4)
			if b == nil {
				return nil
			}
			a = netip.AddrFrom4([4]byte(b))
		case 16:
			b := d.bytes(16)
			if b == nil {
				return nil
			}
			a = netip.AddrFrom16([16]byte(b))
			if a.Is4In6() {
				d.fail("IPv4-mapped endpoint address")
			}
		default:
			d.fail("address length %d", l)
		}
		pb := d.bytes(2)
		c := d.byte()
		if d.err != nil {
			return nil
		}
		port := binary.BigEndian.Uint16(pb)
		if port == 0 || !a.IsValid() || a.IsUnspecified() || c&^7 != 0 {
			d.fail("invalid endpoint %v:%d", a, port)
			return nil
		}
		out = append(out, Endpoint{Addr: netip.AddrPortFrom(a, port), Ready: c&1 != 0, Serving: c&2 != 0, Terminating: c&4 != 0})
	}
	return out
}
