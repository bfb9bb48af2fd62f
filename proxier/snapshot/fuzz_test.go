package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"testing"
)

// FuzzDecode feeds the snapshot reader anything a killed writer, a full disk or another program
// could leave in the file. A file is either rejected whole, with an error wrapping ErrCorrupt or
// ErrVersion and no state, or decodes to a state whose every endpoint is usable and which encodes
// back to the same bytes. Almost every mutation breaks the CRC-32C, so this target fuzzes the
// framing and the checksum gate; FuzzDecodeBody fuzzes what lies behind it.
func FuzzDecode(f *testing.F) {
	for _, seed := range decodeSeeds() {
		f.Add(seed)
	}
	f.Fuzz(checkDecode)
}

// FuzzDecodeBody fuzzes the body parser: the input is what follows the magic (the version, the
// node, the ports, the end marker), and the fuzz function appends the CRC-32C the body needs, so
// every mutation reaches the parser instead of stopping at the checksum.
func FuzzDecodeBody(f *testing.F) {
	for _, seed := range decodeSeeds() {
		if len(seed) >= len(magic)+4 && string(seed[:len(magic)]) == magic {
			f.Add(seed[len(magic) : len(seed)-4])
		}
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		checkDecode(t, seal(body))
	})
}

func decodeSeeds() [][]byte {
	good := Encode(testState())
	return [][]byte{good, Encode(&State{}), good[:len(good)/2], []byte(magic)}
}

// seal frames body as a file: the magic, body, and the checksum of both.
func seal(body []byte) []byte {
	b := append([]byte(magic), body...)
	return binary.BigEndian.AppendUint32(b, crc32.Checksum(b, crcTable))
}

func checkDecode(t *testing.T, data []byte) {
	st, err := Decode(data)
	if err != nil {
		if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrVersion) {
			t.Fatalf("Decode(%q) = %v; want an error wrapping ErrCorrupt or ErrVersion", data, err)
		}
		if st != nil {
			t.Fatalf("Decode(%q) failed (%v) yet returned a state", data, err)
		}
		return
	}
	for _, p := range st.Ports {
		for _, e := range append(p.Internal, p.External...) {
			if !e.Addr.IsValid() || e.Addr.Port() == 0 || e.Addr.Addr().IsUnspecified() || e.Addr.Addr().Is4In6() {
				t.Fatalf("Decode(%q) accepted endpoint %v of %s", data, e.Addr, p.Name)
			}
		}
	}
	if again := Encode(st); !bytes.Equal(again, data) {
		t.Fatalf("Decode(%q) then Encode = %q; want the same bytes", data, again)
	}
}
