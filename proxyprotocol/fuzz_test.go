package proxyprotocol

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"
)

// specHeader is a header as read by specParse: the parser written for these tests from the spec
// (haproxy.org/download/2.9/doc/proxy-protocol.txt, sections 2.1 and 2.2), independent of Parse,
// so that the encoder is not checked against its own reading of the format.
type specHeader struct {
	family   string // "TCP4", "TCP6" or "" (v1 UNKNOWN, v2 LOCAL)
	src, dst netip.AddrPort
	n        int // bytes the header took
}

// specParse reads one header that must make up all of b.
func specParse(b []byte, v Version) (specHeader, error) {
	switch v {
	case V1:
		return specParseV1(b)
	case V2:
		return specParseV2(b)
	}
	return specHeader{}, fmt.Errorf("version %v", v)
}

// specParseV1: "PROXY" SP family SP src SP dst SP sport SP dport CRLF, at most 107 bytes, or
// "PROXY UNKNOWN" ... CRLF. Addresses are written as inet_ntop writes them, ports in decimal
// without leading zeros.
func specParseV1(b []byte) (specHeader, error) {
	if len(b) > 107 {
		return specHeader{}, fmt.Errorf("v1 line of %d bytes, the spec allows 107", len(b))
	}
	line, ok := bytes.CutSuffix(b, []byte("\r\n"))
	if !ok || bytes.Contains(line, []byte("\r")) || bytes.Contains(line, []byte("\n")) {
		return specHeader{}, errors.New("v1 line does not end in a single CRLF")
	}
	for _, c := range line {
		if c < 0x20 || c > 0x7e {
			return specHeader{}, fmt.Errorf("v1 line has the byte %#x: the spec allows printable US-ASCII only", c)
		}
	}
	f := strings.Split(string(line), " ")
	if f[0] != "PROXY" {
		return specHeader{}, errors.New(`v1 line does not start with "PROXY "`)
	}
	if len(f) == 2 && f[1] == "UNKNOWN" {
		return specHeader{n: len(b)}, nil
	}
	if len(f) != 6 || (f[1] != "TCP4" && f[1] != "TCP6") {
		return specHeader{}, fmt.Errorf("v1 line %q: want 6 single-space separated fields", line)
	}
	h := specHeader{family: f[1], n: len(b)}
	var addrs [2]netip.Addr
	var ports [2]uint16
	for i := range 2 {
		a, err := netip.ParseAddr(f[2+i])
		if err != nil || a.Zone() != "" || a.Is4() != (f[1] == "TCP4") || a.String() != f[2+i] {
			return specHeader{}, fmt.Errorf("v1 address %q is not a plain %s address in canonical form", f[2+i], f[1])
		}
		p, err := strconv.ParseUint(f[4+i], 10, 16)
		if err != nil || strconv.FormatUint(p, 10) != f[4+i] {
			return specHeader{}, fmt.Errorf("v1 port %q", f[4+i])
		}
		addrs[i], ports[i] = a, uint16(p)
	}
	h.src, h.dst = netip.AddrPortFrom(addrs[0], ports[0]), netip.AddrPortFrom(addrs[1], ports[1])
	return h, nil
}

// specParseV2: the 12-byte signature, 0x2? (version 2, command), family and transport, a 16-bit
// big-endian length, then that many bytes (the addresses for PROXY; nothing is required for
// LOCAL).
func specParseV2(b []byte) (specHeader, error) {
	sig := []byte("\r\n\r\n\x00\r\nQUIT\n")
	if len(b) < 16 || !bytes.Equal(b[:12], sig) {
		return specHeader{}, errors.New("v2 header without its signature")
	}
	if n := 16 + int(binary.BigEndian.Uint16(b[14:16])); n != len(b) {
		return specHeader{}, fmt.Errorf("v2 length says %d bytes, the header has %d", n, len(b))
	}
	body := b[16:]
	switch cmd := b[12]; {
	case cmd == 0x20: // LOCAL: the receiver uses the connection's own addresses
		return specHeader{n: len(b)}, nil
	case cmd != 0x21:
		return specHeader{}, fmt.Errorf("v2 version/command %#x", cmd)
	}
	h := specHeader{n: len(b)}
	switch fam := b[13]; {
	case fam == 0x11 && len(body) == 12:
		h.family = "TCP4"
		h.src = netip.AddrPortFrom(netip.AddrFrom4([4]byte(body[0:4])), binary.BigEndian.Uint16(body[8:10]))
		h.dst = netip.AddrPortFrom(netip.AddrFrom4([4]byte(body[4:8])), binary.BigEndian.Uint16(body[10:12]))
	case fam == 0x21 && len(body) == 36:
		h.family = "TCP6"
		h.src = netip.AddrPortFrom(netip.AddrFrom16([16]byte(body[0:16])), binary.BigEndian.Uint16(body[32:34]))
		h.dst = netip.AddrPortFrom(netip.AddrFrom16([16]byte(body[16:32])), binary.BigEndian.Uint16(body[34:36]))
	default:
		return specHeader{}, fmt.Errorf("v2 family/transport %#x with %d address bytes", fam, len(body))
	}
	return h, nil
}

// fuzzAddr makes an address of the fuzzer's bytes: 4 bytes IPv4, 16 bytes IPv6 (with zone when
// one is given), anything else invalid (unknown).
func fuzzAddr(raw []byte, port uint16, zone string) netip.AddrPort {
	var a netip.Addr
	switch len(raw) {
	case 4:
		a = netip.AddrFrom4([4]byte(raw))
	case 16:
		a = netip.AddrFrom16([16]byte(raw)).WithZone(zone)
	default:
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(a, port)
}

// FuzzHeaderRoundTrip encodes a header of any two addresses in both versions and reads it back
// with the spec parser of the tests: it must be a header the spec allows, at most MaxLen bytes,
// carrying the addresses (both IPv4 unmapped, else both IPv6, zones dropped) and ports, or UNKNOWN
// / LOCAL when an address is missing. Parse must read the same.
func FuzzHeaderRoundTrip(f *testing.F) {
	v4 := func(s string) []byte { a := netip.MustParseAddr(s).As4(); return a[:] }
	v6 := func(s string) []byte { a := netip.MustParseAddr(s).As16(); return a[:] }
	f.Add(v4("192.0.2.10"), uint16(51234), v4("198.51.100.7"), uint16(80), "")
	f.Add(v6("2001:db8::10"), uint16(51234), v6("2001:db8::7"), uint16(80), "")
	f.Add(v6("::ffff:192.0.2.10"), uint16(1), v4("198.51.100.7"), uint16(65535), "")
	f.Add(v6("fe80::1"), uint16(1), v6("fe80::2"), uint16(2), "eth0")
	f.Add([]byte{}, uint16(0), v4("0.0.0.0"), uint16(0), "")
	f.Fuzz(func(t *testing.T, src []byte, sport uint16, dst []byte, dport uint16, zone string) {
		h := Header{Source: fuzzAddr(src, sport, zone), Destination: fuzzAddr(dst, dport, zone)}
		for _, v := range []Version{V1, V2} {
			prefix := []byte("prefix")
			b := h.Append(prefix, v)[len(prefix):]
			if len(b) > MaxLen {
				t.Fatalf("%v header of %v is %d bytes, more than MaxLen %d", v, h, len(b), MaxLen)
			}
			got, err := specParse(b, v)
			if err != nil {
				t.Fatalf("%v header of %v = %q: %v", v, h, b, err)
			}
			want := expectedSpec(h)
			want.n = len(b)
			if got != want {
				t.Fatalf("%v header of %v = %q, reads as %+v, want %+v", v, h, b, got, want)
			}
			ph, pv, n, err := Parse(append(b, "payload"...))
			if err != nil || pv != v || n != len(b) || ph.Source != got.src || ph.Destination != got.dst {
				t.Fatalf("Parse(%q) = %v %v %d %v; the spec parser read %+v", b, ph, pv, n, err, got)
			}
		}
	})
}

// expectedSpec is what a header of h must say: both addresses IPv4 (unmapped) when both are,
// else both as IPv6, zones dropped; nothing when one is missing.
func expectedSpec(h Header) specHeader {
	if !h.Source.IsValid() || !h.Destination.IsValid() {
		return specHeader{}
	}
	s, d := h.Source.Addr().Unmap().WithZone(""), h.Destination.Addr().Unmap().WithZone("")
	fam := "TCP4"
	if !s.Is4() || !d.Is4() {
		fam = "TCP6"
		s, d = netip.AddrFrom16(s.As16()), netip.AddrFrom16(d.As16())
	}
	return specHeader{family: fam, src: netip.AddrPortFrom(s, h.Source.Port()), dst: netip.AddrPortFrom(d, h.Destination.Port())}
}

// FuzzParse feeds Parse anything (it reads what the tests' endpoints receive): it must not
// panic, must not claim more bytes than it got, and a header it accepts must encode back to a
// header that reads the same.
func FuzzParse(f *testing.F) {
	f.Add([]byte("PROXY TCP4 192.0.2.10 198.51.100.7 51234 80\r\nGET /"))
	f.Add([]byte("PROXY UNKNOWN\r\n"))
	f.Add([]byte("PROXY TCP6 2001:db8::10 2001:db8::7 1 2\r\n"))
	f.Add(Header{client6, service6}.AppendV2(nil))
	f.Add(Header{client4, service4}.AppendV2(nil))
	f.Add(Header{}.AppendV2(nil))
	f.Add([]byte("\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c\xc0\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, v, n, err := Parse(b)
		if err != nil {
			if n != 0 {
				t.Fatalf("Parse(%q) failed (%v) yet claims %d bytes", b, err, n)
			}
			return
		}
		if n <= 0 || n > len(b) {
			t.Fatalf("Parse(%q) claims %d of %d bytes", b, n, len(b))
		}
		if v != V1 && v != V2 {
			t.Fatalf("Parse(%q) = version %v", b, v)
		}
		// The encoder writes IPv4-mapped addresses as IPv4: compare what the two headers mean.
		again, v2, _, err := Parse(h.Append(nil, v))
		if err != nil || v2 != v || expectedSpec(again) != expectedSpec(h) {
			t.Fatalf("Parse(%q) = %v; encoded again it reads %v, %v", b, h, again, err)
		}
	})
}
