package snapshot

// Address plan: endpoints in 10.244.0.0/16 and fd00:244::/64, proxy ports 30000-40000; nothing is
// dialled, the tests only encode, write and read files in a temporary directory.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/procstat"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

func testState() *State {
	return &State{
		Node:    "node-a",
		Written: time.Unix(1700000000, 123456789),
		Ports: []Port{
			{
				Name: service.ServicePortName{Namespace: "default", Name: "web", Port: "http"}, Protocol: service.TCP,
				ProxyPort: 33001, ExternalProxyPort: 33002, Split: true,
				Affinity:  service.Affinity{ClientIP: true, Timeout: 30 * time.Second},
				Balancing: service.Balancing{Algorithm: service.LeastConnections, SlowStart: 5 * time.Second, Outlier: service.Outlier{ConsecutiveFailures: 3, EjectionTime: time.Minute, MaxEjectionPercent: 50}},
				Internal: []Endpoint{
					{Addr: netip.MustParseAddrPort("10.244.1.2:8080"), Ready: true, Serving: true},
					{Addr: netip.MustParseAddrPort("[fd00:244::3]:8080"), Serving: true, Terminating: true},
				},
				External:   []Endpoint{{Addr: netip.MustParseAddrPort("10.244.1.2:8080"), Ready: true, Serving: true}},
				LastActive: time.Unix(1699999990, 0),
			},
			{Name: service.ServicePortName{Namespace: "kube-system", Name: "dns"}, Protocol: service.UDP, ProxyPort: 33003,
				Internal: []Endpoint{{Addr: netip.MustParseAddrPort("10.244.2.9:53"), Ready: true, Serving: true}}},
			{Name: service.ServicePortName{Namespace: "empty", Name: "none", Port: "p"}, Protocol: service.TCP, ProxyPort: 33004},
		},
	}
}

func TestRoundTrip(t *testing.T) {
	want := testState()
	got, err := Decode(Encode(want))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b })); diff != "" {
		t.Errorf("round trip (-want +got):\n%s", diff)
	}
}

// version1 is a file of format version 1 as a build before the last activity wrote it (from
// testdata/version1.snap), with a valid checksum.
func version1() []byte {
	b, err := os.ReadFile(filepath.Join("testdata", "version1.snap"))
	if err != nil {
		panic(err)
	}
	return b
}

func TestDecodeRejects(t *testing.T) {
	good := Encode(testState())
	flip := func(i int) []byte {
		b := append([]byte(nil), good...)
		b[i] ^= 0x40
		return b
	}
	// Version 3 of the same content, with a checksum that matches.
	encodedV3 := append([]byte(magic), 3)
	encodedV3 = append(encodedV3, good[len(magic)+1:len(good)-4]...)
	encodedV3 = binary.BigEndian.AppendUint32(encodedV3, crc32.Checksum(encodedV3, crcTable))
	for _, tc := range []struct {
		name string
		data []byte
		want error
	}{
		{"empty", nil, ErrCorrupt},
		{"not a snapshot", []byte(`{"version":1,"ports":[]}`), ErrCorrupt},
		{"truncated", good[:len(good)/2], ErrCorrupt},
		{"one byte short", good[:len(good)-1], ErrCorrupt},
		{"a bit flipped in the body", flip(len(good) / 2), ErrCorrupt},
		{"a bit flipped in the checksum", flip(len(good) - 1), ErrCorrupt},
		{"another version", encodedV3, ErrVersion},
		{"version 1 (no last activity)", version1(), ErrVersion},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := Decode(tc.data)
			if !errors.Is(err, tc.want) || st != nil {
				t.Errorf("Decode = %v, %v; want nil and an error wrapping %v", st, err, tc.want)
			}
		})
	}
}

func TestWriteRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "restart-snapshot")

	t.Run("missing file is no state", func(t *testing.T) {
		st, err := Read(path, "node-a")
		if st != nil || err != nil {
			t.Fatalf("Read of a missing file = %v, %v; want nil, nil", st, err)
		}
	})
	t.Run("written atomically, owner only", func(t *testing.T) {
		if err := Write(path, testState()); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("mode %v; want 0600", fi.Mode().Perm())
		}
		entries, _ := os.ReadDir(dir)
		if len(entries) != 1 {
			t.Errorf("directory holds %d entries after a write; want only the snapshot (no temporary file left)", len(entries))
		}
		st, err := Read(path, "node-a")
		if err != nil || st == nil || len(st.Ports) != 3 {
			t.Fatalf("Read = %v, %v; want the 3 ports written", st, err)
		}
	})
	t.Run("another node's snapshot is refused", func(t *testing.T) {
		st, err := Read(path, "node-b")
		if !errors.Is(err, ErrOtherNode) || st != nil {
			t.Errorf("Read on another node = %v, %v; want an error wrapping ErrOtherNode", st, err)
		}
	})
	t.Run("a failed write leaves the old snapshot", func(t *testing.T) {
		// A path in a directory that does not exist: the temporary file cannot be created.
		if err := Write(filepath.Join(dir, "gone", "x"), testState()); err == nil {
			t.Fatal("Write into a missing directory worked")
		}
		if st, err := Read(path, "node-a"); err != nil || st == nil {
			t.Fatalf("the old snapshot: %v, %v", st, err)
		}
	})
	t.Run("a killed writer's temporary files are removed, nothing else", func(t *testing.T) {
		stale := filepath.Join(dir, tempPrefix(path)+"12345")
		other := filepath.Join(dir, ".restart-snapshot-other")
		for _, f := range []string{stale, other} {
			if err := os.WriteFile(f, []byte("half"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if err := RemoveStale(path); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stale temporary file still there: %v", err)
		}
		for _, f := range []string{other, path} {
			if _, err := os.Stat(f); err != nil {
				t.Errorf("%s: %v; want it kept", f, err)
			}
		}
		_ = os.Remove(other)
	})
	t.Run("a corrupt file is an error, not a state", func(t *testing.T) {
		if err := os.WriteFile(path, []byte("KPPSNAP\ngarbage"), 0o600); err != nil {
			t.Fatal(err)
		}
		st, err := Read(path, "node-a")
		if !errors.Is(err, ErrCorrupt) || st != nil {
			t.Errorf("Read = %v, %v; want an error wrapping ErrCorrupt", st, err)
		}
	})
}

// bigState is n service ports of five endpoints each, the shape of bench/scale's load.
func bigState(n int) *State {
	st := &State{Node: "node-a", Written: time.Now()}
	for i := range n {
		p := Port{Name: service.ServicePortName{Namespace: "bulk", Name: fmt.Sprintf("svc-%d", i), Port: "http"}, Protocol: service.TCP, ProxyPort: uint16(30000 + i)}
		for j := range 5 {
			p.Internal = append(p.Internal, Endpoint{Addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(j)}), 8080), Ready: true, Serving: true})
		}
		st.Ports = append(st.Ports, p)
	}
	return st
}

// BenchmarkWrite is the cost of one snapshot write at 10,000 ports (encode, write, rename).
func BenchmarkWrite(b *testing.B) {
	st := bigState(10000)
	path := filepath.Join(b.TempDir(), "snap")
	b.ReportAllocs()
	cpu0 := procstat.CPUTime(os.Getpid())
	for b.Loop() {
		if err := Write(path, st); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(procstat.CPUTime(os.Getpid())-cpu0)/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(len(Encode(st))), "bytes/file")
}

// BenchmarkRead is what a restart pays before it can serve from the snapshot at 10,000 ports.
func BenchmarkRead(b *testing.B) {
	path := filepath.Join(b.TempDir(), "snap")
	if err := Write(path, bigState(10000)); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	cpu0 := procstat.CPUTime(os.Getpid())
	for b.Loop() {
		if _, err := Read(path, "node-a"); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(procstat.CPUTime(os.Getpid())-cpu0)/float64(b.N), "cpu-ns/op")
}
