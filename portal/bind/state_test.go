package bind

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: cluster IPs 10.96.0.10 and fd00:96::10 at port 80, node port 30080 on the
// wildcards, load-balancer IP 198.51.100.20 with a source range; 10.96.0.53 is a DNS cluster IP.

func listenStates() []ListenState {
	ap := netip.MustParseAddrPort
	return []ListenState{
		{Name: spn("kube-system", "dns", "dns"), Protocol: service.UDP, Listen: []netip.AddrPort{ap("10.96.0.53:53")}},
		{Name: spn("default", "web", "http"), Protocol: service.TCP,
			Listen:          []netip.AddrPort{ap("10.96.0.10:80"), ap("[fd00:96::10]:80")},
			External:        []netip.AddrPort{ap("198.51.100.20:80"), ap("0.0.0.0:30080"), ap("[::]:30080")},
			LoadBalancerIPs: addrs("198.51.100.20"), SourceRanges: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}},
	}
}

func TestStateFile(t *testing.T) {
	t.Run("round_trip_in_a_stable_order", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "bind-state.json")
		f := &StateFile{Path: path}
		if wrote, err := f.Save(listenStates()); err != nil || !wrote {
			t.Fatalf("Save = %v, %v; want a write", wrote, err)
		}
		got, err := ReadState(path)
		if err != nil {
			t.Fatal(err)
		}
		want := listenStates()
		want[0], want[1] = want[1], want[0] // sorted by name
		if d := cmp.Diff(want, got, cmp.Comparer(func(a, b netip.Addr) bool { return a == b }),
			cmp.Comparer(func(a, b netip.AddrPort) bool { return a == b }), cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); d != "" {
			t.Errorf("read back (-want +got):\n%s", d)
		}
	})
	t.Run("unchanged_state_is_not_rewritten", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "bind-state.json")
		f := &StateFile{Path: path}
		if _, err := f.Save(listenStates()); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		st := listenStates()
		st[0], st[1] = st[1], st[0]
		if wrote, err := f.Save(st); err != nil || wrote {
			t.Errorf("Save of the same ports in another order = %v, %v; want no write", wrote, err)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the file was written again: %v", err)
		}
		if wrote, err := f.Save(st[:1]); err != nil || !wrote {
			t.Errorf("Save of a changed state = %v, %v; want a write", wrote, err)
		}
	})
	t.Run("write_replaces_the_file_and_leaves_no_temporary_file", func(t *testing.T) {
		dir := t.TempDir()
		path := filepath.Join(dir, "bind-state.json")
		if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
			t.Fatal(err)
		}
		// A reader holding the old file keeps reading the old content: the new one is renamed in.
		old, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer old.Close()
		if _, err := (&StateFile{Path: path}).Save(listenStates()); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 16)
		n, _ := old.Read(buf)
		if string(buf[:n]) != "old" {
			t.Errorf("the old file was overwritten in place: %q", buf[:n])
		}
		entries, _ := os.ReadDir(dir)
		if len(entries) != 1 {
			t.Errorf("directory holds %d entries, want only the state file: %v", len(entries), entries)
		}
		if got, err := ReadState(path); err != nil || len(got) != 2 {
			t.Errorf("ReadState = %d ports, %v; want 2", len(got), err)
		}
	})
	t.Run("failed_write_keeps_the_previous_file", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "missing-dir", "bind-state.json")
		if _, err := (&StateFile{Path: path}).Save(listenStates()); err == nil {
			t.Error("Save into a missing directory succeeded")
		}
	})
}

func TestReadState(t *testing.T) {
	for _, tc := range []struct {
		name    string
		content string // "" means no file
		ports   int
		corrupt bool
	}{
		{name: "missing_file_is_no_state"},
		{name: "corrupt_file", content: `{"version":1,"ports":[{`, corrupt: true},
		{name: "unknown_version", content: `{"version":2,"ports":[]}`, corrupt: true},
		{name: "bad_address", content: `{"version":1,"ports":[{"listen":["10.96.0.300:80"]}]}`, corrupt: true},
		// Files a proxy of this version never writes: each was accepted (and reopened) before
		// the entries were checked.
		{name: "another_protocol", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"SCTP","listen":["10.96.0.1:80"]}]}`, corrupt: true},
		{name: "no_protocol", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"listen":["10.96.0.1:80"]}]}`, corrupt: true},
		{name: "no_name", content: `{"version":1,"ports":[{"protocol":"TCP","listen":["10.96.0.1:80"]}]}`, corrupt: true},
		{name: "no_listen_address", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"TCP"}]}`, corrupt: true},
		{name: "listen_port_zero", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"TCP","listen":["10.96.0.1:0"]}]}`, corrupt: true},
		{name: "listen_with_zone", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"TCP","listen":["[fe80::1%eth0]:80"]}]}`, corrupt: true},
		{name: "empty_load_balancer_ip", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"TCP","listen":["10.96.0.1:80"],"loadBalancerIPs":[""]}]}`, corrupt: true},
		{name: "empty_source_range", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"TCP","listen":["10.96.0.1:80"],"sourceRanges":[""]}]}`, corrupt: true},
		{name: "name_listed_twice", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b"},"protocol":"TCP","listen":["10.96.0.1:80"]},{"name":{"Namespace":"a","Name":"b"},"protocol":"UDP","listen":["10.96.0.1:80"]}]}`, corrupt: true},
		{name: "valid", content: `{"version":1,"ports":[{"name":{"Namespace":"a","Name":"b","Port":"c"},"protocol":"TCP","listen":["10.96.0.1:80"]}]}`, ports: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "bind-state.json")
			if tc.content != "" {
				if err := os.WriteFile(path, []byte(tc.content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			got, err := ReadState(path)
			if errors.Is(err, ErrStateCorrupt) != tc.corrupt || (!tc.corrupt && err != nil) {
				t.Fatalf("ReadState error = %v; want corrupt %v", err, tc.corrupt)
			}
			if len(got) != tc.ports {
				t.Errorf("ReadState = %d ports, want %d", len(got), tc.ports)
			}
		})
	}
}

func TestPresent(t *testing.T) {
	local := map[netip.Addr]bool{netip.MustParseAddr("10.96.0.10"): true, netip.MustParseAddr("fd00:96::10"): true,
		netip.MustParseAddr("198.51.100.20"): true}
	got := Present(listenStates(), func(a netip.Addr) bool { return local[a] })
	if len(got) != 1 || got[0].Name != spn("default", "web", "http") {
		t.Errorf("Present kept %v; want only default/web:http (the DNS cluster IP left the link, wildcards always stay)", got)
	}
}
