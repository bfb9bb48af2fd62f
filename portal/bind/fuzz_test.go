package bind

import (
	"encoding/json"
	"errors"
	"net/netip"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// FuzzDecodeState feeds the bind state reader anything a crashed writer, a full disk or another
// program could leave in the file. A file is either rejected whole, with an error wrapping
// ErrStateCorrupt and no port, or every port in it can be reopened as it says (checked here
// independently of validate) and survives a Save and ReadState unchanged.
func FuzzDecodeState(f *testing.F) {
	good, err := json.Marshal(stateFile{Version: StateVersion, Ports: listenStates()})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add([]byte(`{"version":1,"ports":[]}`))
	f.Add([]byte(`{"version":1,"ports":null}`))
	f.Add([]byte(`{"version":2,"ports":[]}`))
	f.Add([]byte(`{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"SCTP","listen":["10.96.0.1:80"]}]}`))
	f.Add([]byte(`{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"UDP","port":53,"listen":["[fd00::1]:53"],"external":["0.0.0.0:30053"],"loadBalancerIPs":["198.51.100.1"],"sourceRanges":["0.0.0.0/0"]}]}`))
	f.Add(good[:len(good)/2])
	f.Fuzz(func(t *testing.T, data []byte) {
		ports, err := decodeState(data)
		if err != nil {
			if !errors.Is(err, ErrStateCorrupt) {
				t.Fatalf("decodeState(%q) = %v; want an error wrapping ErrStateCorrupt", data, err)
			}
			if ports != nil {
				t.Fatalf("decodeState(%q) failed (%v) yet returned %d ports", data, err, len(ports))
			}
			return
		}
		names := map[service.ServicePortName]bool{}
		for _, p := range ports {
			if !reopenable(p) || names[p.Name] {
				t.Fatalf("decodeState(%q) accepted a port that cannot be reopened as it says: %+v", data, p)
			}
			names[p.Name] = true
		}
		path := filepath.Join(t.TempDir(), "state.json")
		if _, err := (&StateFile{Path: path}).Save(ports); err != nil {
			t.Fatal(err)
		}
		again, err := ReadState(path)
		if err != nil {
			t.Fatalf("a saved state does not read back: %v", err)
		}
		// Empty lists are written as absent (omitempty) and read back as nil: the same state
		// (testdata/fuzz/FuzzDecodeState/ keeps the input that showed it).
		cmpAddrs := []cmp.Option{cmpopts.EquateEmpty(), cmp.Comparer(func(a, b netip.Addr) bool { return a == b }),
			cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b }), cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })}
		if d := cmp.Diff(sortedStates(ports), again, cmpAddrs...); d != "" {
			t.Fatalf("saved and read back (-decoded +read):\n%s", d)
		}
	})
}

// reopenable is what the proxier needs of a port to reopen it: a name, TCP or UDP, and at least
// one address with a port to listen on, every address valid and zone-free.
func reopenable(p ListenState) bool {
	if p.Name.Namespace == "" || p.Name.Name == "" || (p.Protocol != service.TCP && p.Protocol != service.UDP) || len(p.Listen) == 0 {
		return false
	}
	for _, list := range [][]netip.AddrPort{p.Listen, p.External} {
		for _, a := range list {
			if !a.Addr().IsValid() || a.Addr().Zone() != "" || a.Port() == 0 {
				return false
			}
		}
	}
	for _, a := range p.LoadBalancerIPs {
		if !a.IsValid() {
			return false
		}
	}
	for _, r := range p.SourceRanges {
		if !r.IsValid() {
			return false
		}
	}
	return true
}

// sortedStates is ports in the order Save writes them.
func sortedStates(ports []ListenState) []ListenState {
	out := append([]ListenState(nil), ports...)
	sortStates(out)
	return out
}
