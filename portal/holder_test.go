package portal

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: node addresses 192.168.1.10 and 203.0.113.7 (an external IP that is local);
// cluster IPs 10.96.0.0/16 are not local.

type fakeSockets struct {
	open  map[string]bool
	taken map[string]bool // ports "another process" holds
}

type fakeSock struct {
	s   *fakeSockets
	key string
}

func (f fakeSock) Close() error { delete(f.s.open, f.key); return nil }

func (s *fakeSockets) listen(proto service.Protocol, addr netip.AddrPort) (io.Closer, error) {
	key := holdKey{addr: addr.Addr(), port: addr.Port(), proto: proto}.String()
	if s.taken[key] {
		return nil, syscall.EADDRINUSE
	}
	s.open[key] = true
	return fakeSock{s, key}, nil
}

func (s *fakeSockets) list() []string {
	var out []string
	for k := range s.open {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func newTestHolder() (*PortHolder, *fakeSockets) {
	socks := &fakeSockets{open: map[string]bool{}, taken: map[string]bool{}}
	h := NewPortHolder(HolderConfig{
		LocalAddrs: func() ([]netip.Addr, error) { return addrs("192.168.1.10", "203.0.113.7"), nil },
		Listen:     socks.listen,
	})
	return h, socks
}

func TestPortHolder(t *testing.T) {
	web := Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10"), ExternalIPs: addrs("203.0.113.7", "198.51.100.1"), ProxyPort: 34001}
	dns := Spec{Name: spn("kube-system", "dns", "dns"), Protocol: service.UDP, Port: 53, NodePort: 30053,
		ClusterIPs: addrs("10.96.0.53"), ProxyPort: 34002}

	t.Run("holds_node_ports_and_local_portal_ips_only", func(t *testing.T) {
		h, socks := newTestHolder()
		if failed := h.Sync([]Spec{web, dns}); len(failed) != 0 {
			t.Fatal(failed)
		}
		want := []string{"203.0.113.7:80/tcp", ":30053/udp", ":30080/tcp"}
		if got := socks.list(); !slices.Equal(got, want) {
			t.Errorf("held %q, want %q", got, want)
		}
	})

	t.Run("releases_ports_no_longer_wanted", func(t *testing.T) {
		h, socks := newTestHolder()
		h.Sync([]Spec{web, dns})
		web2 := web
		web2.NodePort = 0
		if failed := h.Sync([]Spec{web2}); len(failed) != 0 {
			t.Fatal(failed)
		}
		if got, want := socks.list(), []string{"203.0.113.7:80/tcp"}; !slices.Equal(got, want) {
			t.Errorf("held %q, want %q", got, want)
		}
		if err := h.Close(); err != nil || len(socks.list()) != 0 {
			t.Errorf("after Close: err %v, still held %q", err, socks.list())
		}
	})

	t.Run("conflict_fails_only_the_newcomer", func(t *testing.T) {
		h, _ := newTestHolder()
		// "a/late" sorts first, but "z/first" held the port before it came.
		first := Spec{Name: spn("z", "first", ""), Protocol: service.TCP, Port: 81, NodePort: 30080, ProxyPort: 34003}
		late := Spec{Name: spn("a", "late", ""), Protocol: service.TCP, Port: 82, NodePort: 30080, ProxyPort: 34004}
		h.Sync([]Spec{first, dns})
		failed := h.Sync([]Spec{late, first, dns})
		if len(failed) != 1 || failed[late.Name] == nil || !strings.Contains(failed[late.Name].Error(), "port conflict on :30080/tcp: already held for z/first") {
			t.Errorf("failed = %v, want only a/late with a port conflict", failed)
		}
		if got := WithoutFailed([]Spec{late, first, dns}, failed); len(got) != 2 || got[0].Name != first.Name {
			t.Errorf("WithoutFailed kept %v, want z/first and dns", got)
		}
	})

	t.Run("port_taken_by_another_process_is_retried", func(t *testing.T) {
		h, socks := newTestHolder()
		socks.taken[":30053/udp"] = true
		failed := h.Sync([]Spec{web, dns})
		if len(failed) != 1 || !errors.Is(failed[dns.Name], syscall.EADDRINUSE) {
			t.Fatalf("failed = %v, want only dns with EADDRINUSE", failed)
		}
		delete(socks.taken, ":30053/udp")
		if failed := h.Sync([]Spec{web, dns}); len(failed) != 0 {
			t.Errorf("second Sync failed = %v, want the port held now", failed)
		}
	})
}

// TestPortHolderRealSockets holds a node port with real sockets inside a throwaway namespace and
// checks that nobody else can bind it.
func TestPortHolderRealSockets(t *testing.T) {
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	h := NewPortHolder(HolderConfig{})
	t.Cleanup(func() { h.Close() })
	spec := Spec{Name: spn("default", "web", "http"), Protocol: service.TCP, Port: 80, NodePort: 30080,
		ClusterIPs: addrs("10.96.0.10"), ProxyPort: 34001}
	var failed map[service.ServicePortName]error
	if err := node.Do(func() error { failed = h.Sync([]Spec{spec}); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(failed) != 0 {
		t.Fatal(failed)
	}
	err := node.Do(func() error {
		ln, err := net.Listen("tcp", "127.0.0.1:30080")
		if err == nil {
			ln.Close()
		}
		return err
	})
	if !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("listen on the held node port: err %v, want EADDRINUSE", err)
	}
}
