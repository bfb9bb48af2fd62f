package snapshot

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzDecode feeds the snapshot reader anything a killed writer, a full disk or another program
// could leave in the file. A file is either rejected whole, with an error wrapping ErrCorrupt or
// ErrVersion and no state, or decodes to a state whose every endpoint is usable and which encodes
// back to the same bytes.
func FuzzDecode(f *testing.F) {
	good := Encode(testState())
	f.Add(good)
	f.Add(Encode(&State{}))
	f.Add(good[:len(good)/2])
	f.Add([]byte(magic))
	f.Fuzz(func(t *testing.T, data []byte) {
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
	})
}
