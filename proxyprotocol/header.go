// Package proxyprotocol builds the PROXY protocol header (HAProxy's spec, versions 1 and 2) that a
// TCP proxy sends an endpoint before the client's first byte, so a backend that speaks it (nginx,
// HAProxy, Envoy, many ingress controllers) sees the real client address and port. It also parses
// one, for tests.
package proxyprotocol

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
)

// Version is the PROXY protocol version a service port sends; Off sends nothing.
type Version uint8

// The versions, as the portal-proxy.kubernetes.io/proxy-protocol annotation spells them ("v1",
// "v2").
const (
	Off Version = iota
	V1          // human-readable: "PROXY TCP4 src dst sport dport\r\n"
	V2          // binary: a 16-byte preamble, then the addresses
)

// ParseVersion reads "v1" or "v2".
func ParseVersion(s string) (Version, error) {
	switch s {
	case "v1":
		return V1, nil
	case "v2":
		return V2, nil
	}
	return Off, fmt.Errorf("proxy protocol version %q: want v1 or v2", s)
}

func (v Version) String() string {
	switch v {
	case Off:
		return ""
	case V1, V2:
		return "v" + strconv.Itoa(int(v))
	}
	return fmt.Sprintf("Version(%d)", v)
}

// MaxLen bounds the header either version needs for TCP over IPv4 or IPv6: v1's spec caps a line
// at 107 bytes; v2 with two IPv6 addresses is 52.
const MaxLen = 107

// v2Signature starts every version 2 header.
var v2Signature = [12]byte{'\r', '\n', '\r', '\n', 0, '\r', '\n', 'Q', 'U', 'I', 'T', '\n'}

// Version 2 fields (section 2.2 of the spec).
const (
	v2Local   = 0x20 // version 2, command LOCAL: the connection is the proxy's own
	v2Proxy   = 0x21 // version 2, command PROXY: the addresses follow
	v2TCP4    = 0x11 // AF_INET, STREAM
	v2TCP6    = 0x21 // AF_INET6, STREAM
	v2Unspec  = 0x00
	v2Len4    = 12 // two IPv4 addresses and two ports
	v2Len6    = 36 // two IPv6 addresses and two ports
	v2HeadLen = 16
)

// Header is what the proxy tells the endpoint about a client connection: Source is the client's
// address, Destination the address the client connected to. When either is invalid the header
// says the addresses are unknown (v1 "PROXY UNKNOWN", v2 LOCAL), and the backend uses the
// connection's own addresses.
type Header struct {
	Source, Destination netip.AddrPort
}

// addrs returns the two addresses in one family: both IPv4, or both IPv6 (an IPv4 address beside
// an IPv6 one is written IPv4-mapped). ok is false when one of them is missing.
func (h Header) addrs() (src, dst netip.AddrPort, v4, ok bool) {
	if !h.Source.IsValid() || !h.Destination.IsValid() {
		return src, dst, false, false
	}
	s, d := h.Source.Addr().Unmap(), h.Destination.Addr().Unmap()
	if s.Is4() && d.Is4() {
		return netip.AddrPortFrom(s, h.Source.Port()), netip.AddrPortFrom(d, h.Destination.Port()), true, true
	}
	s, d = netip.AddrFrom16(s.As16()), netip.AddrFrom16(d.As16())
	return netip.AddrPortFrom(s, h.Source.Port()), netip.AddrPortFrom(d, h.Destination.Port()), false, true
}

// Append appends the header in version v to b. Off appends nothing.
func (h Header) Append(b []byte, v Version) []byte {
	switch v {
	case V1:
		return h.AppendV1(b)
	case V2:
		return h.AppendV2(b)
	}
	return b
}

// AppendV1 appends the text form: "PROXY TCP4 192.0.2.1 198.51.100.7 51234 80\r\n".
func (h Header) AppendV1(b []byte) []byte {
	src, dst, v4, ok := h.addrs()
	if !ok {
		return append(b, "PROXY UNKNOWN\r\n"...)
	}
	b = append(b, "PROXY TCP"...)
	if v4 {
		b = append(b, '4', ' ')
	} else {
		b = append(b, '6', ' ')
	}
	b = src.Addr().AppendTo(b)
	b = append(b, ' ')
	b = dst.Addr().AppendTo(b)
	b = append(b, ' ')
	b = strconv.AppendUint(b, uint64(src.Port()), 10)
	b = append(b, ' ')
	b = strconv.AppendUint(b, uint64(dst.Port()), 10)
	return append(b, '\r', '\n')
}

// AppendV2 appends the binary form: signature, version and command, family and transport, the
// length of what follows, then source and destination addresses and ports in network order.
func (h Header) AppendV2(b []byte) []byte {
	b = append(b, v2Signature[:]...)
	src, dst, v4, ok := h.addrs()
	if !ok {
		return append(b, v2Local, v2Unspec, 0, 0)
	}
	if v4 {
		b = append(b, v2Proxy, v2TCP4, 0, v2Len4)
		s, d := src.Addr().As4(), dst.Addr().As4()
		b = append(append(b, s[:]...), d[:]...)
	} else {
		b = append(b, v2Proxy, v2TCP6, 0, v2Len6)
		s, d := src.Addr().As16(), dst.Addr().As16()
		b = append(append(b, s[:]...), d[:]...)
	}
	return append(b, byte(src.Port()>>8), byte(src.Port()), byte(dst.Port()>>8), byte(dst.Port()))
}

// ErrIncomplete: the bytes end before the header does.
var ErrIncomplete = errors.New("proxy protocol: incomplete header")

// Parse reads a header at the start of b and returns it, its version and its length. An UNKNOWN
// (v1) or LOCAL (v2) header yields a Header without addresses. TLVs after v2's addresses are
// skipped.
func Parse(b []byte) (Header, Version, int, error) {
	if len(b) >= len(v2Signature) && [12]byte(b[:12]) == v2Signature {
		return parseV2(b)
	}
	if len(b) < 6 {
		return Header{}, Off, 0, ErrIncomplete
	}
	if string(b[:6]) != "PROXY " {
		return Header{}, Off, 0, errors.New("proxy protocol: no header")
	}
	return parseV1(b)
}

func parseV1(b []byte) (Header, Version, int, error) {
	end := -1
	for i := 0; i+1 < len(b) && i < MaxLen; i++ {
		if b[i] == '\r' && b[i+1] == '\n' {
			end = i
			break
		}
	}
	if end < 0 {
		if len(b) < MaxLen {
			return Header{}, V1, 0, ErrIncomplete
		}
		return Header{}, V1, 0, errors.New("proxy protocol v1: no CRLF within 107 bytes")
	}
	n := end + 2
	fields := splitSpaces(string(b[:end]))
	if len(fields) >= 2 && fields[1] == "UNKNOWN" {
		return Header{}, V1, n, nil
	}
	if len(fields) != 6 || (fields[1] != "TCP4" && fields[1] != "TCP6") {
		return Header{}, V1, 0, fmt.Errorf("proxy protocol v1: malformed line %q", b[:end])
	}
	var addrs [2]netip.Addr
	for i := range addrs {
		a, err := netip.ParseAddr(fields[2+i])
		if err != nil || a.Is4() != (fields[1] == "TCP4") {
			return Header{}, V1, 0, fmt.Errorf("proxy protocol v1: address %q does not fit %s", fields[2+i], fields[1])
		}
		addrs[i] = a
	}
	var ports [2]uint16
	for i := range ports {
		p, err := strconv.ParseUint(fields[4+i], 10, 16)
		if err != nil {
			return Header{}, V1, 0, fmt.Errorf("proxy protocol v1: port %q: %w", fields[4+i], err)
		}
		ports[i] = uint16(p)
	}
	return Header{Source: netip.AddrPortFrom(addrs[0], ports[0]), Destination: netip.AddrPortFrom(addrs[1], ports[1])}, V1, n, nil
}

func splitSpaces(s string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ' ' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return out
}

func parseV2(b []byte) (Header, Version, int, error) {
	if len(b) < v2HeadLen {
		return Header{}, V2, 0, ErrIncomplete
	}
	verCmd, fam := b[12], b[13]
	length := int(b[14])<<8 | int(b[15])
	n := v2HeadLen + length
	if len(b) < n {
		return Header{}, V2, 0, ErrIncomplete
	}
	body := b[v2HeadLen:n]
	switch {
	case verCmd>>4 != 2:
		return Header{}, V2, 0, fmt.Errorf("proxy protocol v2: version %d", verCmd>>4)
	case verCmd == v2Local:
		return Header{}, V2, n, nil
	case verCmd != v2Proxy:
		return Header{}, V2, 0, fmt.Errorf("proxy protocol v2: command %#x", verCmd&0xf)
	}
	var h Header
	switch {
	case fam == v2TCP4 && length >= v2Len4:
		src, dst := netip.AddrFrom4([4]byte(body[0:4])), netip.AddrFrom4([4]byte(body[4:8]))
		h.Source = netip.AddrPortFrom(src, uint16(body[8])<<8|uint16(body[9]))
		h.Destination = netip.AddrPortFrom(dst, uint16(body[10])<<8|uint16(body[11]))
	case fam == v2TCP6 && length >= v2Len6:
		src, dst := netip.AddrFrom16([16]byte(body[0:16])), netip.AddrFrom16([16]byte(body[16:32]))
		h.Source = netip.AddrPortFrom(src, uint16(body[32])<<8|uint16(body[33]))
		h.Destination = netip.AddrPortFrom(dst, uint16(body[34])<<8|uint16(body[35]))
	case fam == v2Unspec:
	default:
		return Header{}, V2, 0, fmt.Errorf("proxy protocol v2: family/transport %#x with %d address bytes", fam, length)
	}
	return h, V2, n, nil
}
