package proxyprotocol

import (
	"bytes"
	"encoding/hex"
	"errors"
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// Address plan: clients 192.0.2.10:51234 and [2001:db8::10]:51234 connect to the service
// addresses 198.51.100.7:80 and [2001:db8::7]:80 (documentation ranges).
var (
	client4  = netip.MustParseAddrPort("192.0.2.10:51234")
	service4 = netip.MustParseAddrPort("198.51.100.7:80")
	client6  = netip.MustParseAddrPort("[2001:db8::10]:51234")
	service6 = netip.MustParseAddrPort("[2001:db8::7]:80")
)

// The expected bytes are written out from the spec (haproxy.org/download/2.9/doc/proxy-protocol.txt),
// not produced by the code under test.
func TestHeaderBytes(t *testing.T) {
	const sig = "0d0a0d0a000d0a515549540a"
	for _, tc := range []struct {
		name    string
		h       Header
		v       Version
		wantHex string // v2
		wantTxt string // v1
	}{
		{name: "v1_ipv4", h: Header{client4, service4}, v: V1, wantTxt: "PROXY TCP4 192.0.2.10 198.51.100.7 51234 80\r\n"},
		{name: "v1_ipv6", h: Header{client6, service6}, v: V1, wantTxt: "PROXY TCP6 2001:db8::10 2001:db8::7 51234 80\r\n"},
		{name: "v1_ipv4_mapped_is_ipv4", h: Header{netip.MustParseAddrPort("[::ffff:192.0.2.10]:51234"), service4}, v: V1,
			wantTxt: "PROXY TCP4 192.0.2.10 198.51.100.7 51234 80\r\n"},
		{name: "v1_mixed_families_are_ipv6", h: Header{client4, service6}, v: V1,
			wantTxt: "PROXY TCP6 ::ffff:192.0.2.10 2001:db8::7 51234 80\r\n"},
		{name: "v1_unknown_destination", h: Header{Source: client4}, v: V1, wantTxt: "PROXY UNKNOWN\r\n"},
		{name: "v2_ipv4", h: Header{client4, service4}, v: V2,
			wantHex: sig + "21" + "11" + "000c" + "c000020a" + "c6336407" + "c822" + "0050"},
		{name: "v2_ipv6", h: Header{client6, service6}, v: V2,
			wantHex: sig + "21" + "21" + "0024" + "20010db8000000000000000000000010" + "20010db8000000000000000000000007" + "c822" + "0050"},
		{name: "v2_unknown_is_local", h: Header{}, v: V2, wantHex: sig + "20" + "00" + "0000"},
		{name: "off_writes_nothing", h: Header{client4, service4}, v: Off},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.h.Append([]byte("x"), tc.v)[1:]
			want := []byte(tc.wantTxt)
			if tc.wantHex != "" {
				var err error
				if want, err = hex.DecodeString(tc.wantHex); err != nil {
					t.Fatal(err)
				}
			}
			if !bytes.Equal(got, want) {
				t.Errorf("header bytes:\n got %q\nwant %q", got, want)
			}
			if len(got) > MaxLen {
				t.Errorf("header is %d bytes, more than MaxLen %d", len(got), MaxLen)
			}
		})
	}
}

func TestParseRoundTrip(t *testing.T) {
	longest := Header{netip.MustParseAddrPort("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe]:65535"),
		netip.MustParseAddrPort("[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535")}
	for _, h := range []Header{{client4, service4}, {client6, service6}, longest} {
		for _, v := range []Version{V1, V2} {
			t.Run(v.String()+"_"+h.Source.String(), func(t *testing.T) {
				b := h.Append(nil, v)
				payload := append(b, "GET / HTTP/1.1\r\n"...)
				got, gotV, n, err := Parse(payload)
				if err != nil {
					t.Fatalf("Parse(%q): %v", b, err)
				}
				if diff := cmp.Diff(h, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
					t.Errorf("header (-want +got):\n%s", diff)
				}
				if gotV != v || n != len(b) {
					t.Errorf("Parse = version %v, %d bytes; want %v, %d", gotV, n, v, len(b))
				}
				if len(b) > MaxLen {
					t.Errorf("header is %d bytes, more than MaxLen %d", len(b), MaxLen)
				}
			})
		}
	}
}

func TestParseRejects(t *testing.T) {
	for _, tc := range []struct {
		name       string
		in         string
		incomplete bool
	}{
		{name: "not_a_header", in: "GET / HTTP/1.1\r\n"},
		{name: "v1_cut_short", in: "PROXY TCP4 192.0.2.10", incomplete: true},
		{name: "v1_family_mismatch", in: "PROXY TCP4 2001:db8::1 192.0.2.1 1 2\r\n"},
		{name: "v1_bad_port", in: "PROXY TCP4 192.0.2.10 192.0.2.1 65536 2\r\n"},
		{name: "v2_cut_short", in: "\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c\xc0\x00", incomplete: true},
		{name: "v2_wrong_version", in: "\r\n\r\n\x00\r\nQUIT\n\x31\x11\x00\x00"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := Parse([]byte(tc.in))
			if err == nil {
				t.Fatalf("Parse(%q) succeeded", tc.in)
			}
			if errors.Is(err, ErrIncomplete) != tc.incomplete {
				t.Errorf("Parse(%q) = %v; incomplete want %v", tc.in, err, tc.incomplete)
			}
		})
	}
}

func TestParseVersion(t *testing.T) {
	for in, want := range map[string]Version{"v1": V1, "v2": V2} {
		if got, err := ParseVersion(in); err != nil || got != want || got.String() != in {
			t.Errorf("ParseVersion(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "V1", "1", "v3", "true"} {
		if _, err := ParseVersion(bad); err == nil {
			t.Errorf("ParseVersion(%q) succeeded", bad)
		}
	}
}

// BenchmarkAppend is the header's share of a proxied connection's cost.
func BenchmarkAppend(b *testing.B) {
	h := Header{client6, service6}
	buf := make([]byte, 0, MaxLen)
	for _, v := range []Version{V1, V2} {
		b.Run(v.String(), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				buf = h.Append(buf[:0], v)
			}
		})
	}
}
