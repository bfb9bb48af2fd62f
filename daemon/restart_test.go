package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/bind"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: cluster IPs 10.96.0.10 (still on the link) and 10.96.0.53 (gone), node port 30080
// on the IPv4 wildcard.

func TestBoundSeeds(t *testing.T) {
	ap := netip.MustParseAddrPort
	web := service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}
	dns := service.ServicePortName{Namespace: "kube-system", Name: "dns", Port: "dns"}
	saved := []proxier.Seed{
		{Name: web, Protocol: service.TCP, ProxyPort: 80, Listen: []netip.AddrPort{ap("10.96.0.10:80"), ap("0.0.0.0:30080")}},
		{Name: dns, Protocol: service.UDP, ProxyPort: 53, Listen: []netip.AddrPort{ap("10.96.0.53:53")}},
	}
	local := func() (func(netip.Addr) bool, error) {
		return func(a netip.Addr) bool { return a == netip.MustParseAddr("10.96.0.10") }, nil
	}

	t.Run("saved_seeds_still_on_the_link_come_back", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "bind-state.json")
		saveBoundSeeds(path, logrus.New())(saved)
		got, err := boundSeeds(path, local)(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 1 || got[0].Name != web || got[0].ProxyPort != 80 || len(got[0].Listen) != 2 {
			t.Errorf("seeds = %+v; want only %s on its two addresses (10.96.0.53 left the link)", got, web)
		}
	})
	t.Run("no_file_no_seeds", func(t *testing.T) {
		got, err := boundSeeds(filepath.Join(t.TempDir(), "none.json"), local)(context.Background())
		if err != nil || len(got) != 0 {
			t.Errorf("seeds = %v, %v; want none and no error", got, err)
		}
	})
	t.Run("corrupt_file_is_an_error_and_no_seeds", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "bind-state.json")
		if err := os.WriteFile(path, []byte("{"), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := boundSeeds(path, local)(context.Background())
		if !errors.Is(err, bind.ErrStateCorrupt) || len(got) != 0 {
			t.Errorf("seeds = %v, %v; want none and ErrStateCorrupt", got, err)
		}
	})
	t.Run("a_failing_write_is_logged_once", func(t *testing.T) {
		log, hook := logtest.NewNullLogger()
		save := saveBoundSeeds(filepath.Join(t.TempDir(), "missing", "bind-state.json"), log)
		save(saved)
		save(saved[:1])
		if n := len(hook.AllEntries()); n != 1 {
			t.Errorf("%d log lines for two failed writes, want 1", n)
		}
	})
}

func TestStateWriterWritesTheLatestState(t *testing.T) {
	saved := make(chan []proxier.Seed, 4)
	w := newStateWriter(func(s []proxier.Seed) { saved <- s })
	older := []proxier.Seed{{Name: service.ServicePortName{Name: "older"}}}
	latest := []proxier.Seed{{Name: service.ServicePortName{Name: "latest"}}}
	w.Offer(older)
	w.Offer(latest) // replaces older before it is written
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	select {
	case got := <-saved:
		if len(got) != 1 || got[0].Name.Name != "latest" {
			t.Errorf("wrote %+v, want the latest state", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nothing written")
	}
	cancel()
	<-done
	if len(saved) != 0 {
		t.Errorf("the replaced state was written too: %+v", <-saved)
	}
}

// TestSnapshotSeeds: after a crash in iptables mode the restart snapshot's proxy ports seed the
// reopen, so the rules in force need not be read back before the first answer; only when they
// can stand for those rules. Address plan: proxy ports from the kernel's default ephemeral range
// (32768-60999); service ports 53 and 80 as a bind-mode snapshot names them.
func TestSnapshotSeeds(t *testing.T) {
	web := service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}
	dns := service.ServicePortName{Namespace: "kube-system", Name: "dns", Port: "dns"}
	iptablesSnap := &snapshot.State{Node: "node-1", Ports: []snapshot.Port{
		{Name: web, Protocol: service.TCP, ProxyPort: 40001, ExternalProxyPort: 40002},
		{Name: dns, Protocol: service.UDP, ProxyPort: 40003},
	}}
	bindSnap := &snapshot.State{Node: "node-1", Ports: []snapshot.Port{
		{Name: web, Protocol: service.TCP, ProxyPort: 80},
		{Name: dns, Protocol: service.UDP, ProxyPort: 53},
	}}
	inRange := proxyPortRange(proxier.PortRange{Base: 32768, Size: 60999 - 32768 + 1})
	v4 := []portal.Family{portal.IPv4}
	for _, tc := range []struct {
		name     string
		st       *snapshot.State
		fams     []portal.Family
		bindLink bool
		want     []string // name/proto:port/external, in order; nil: read the rules
	}{
		{"an iptables-mode snapshot seeds the reopen, in name order", iptablesSnap, v4, false,
			[]string{"kube-system/dns:dns/UDP:40003/0", "ns/web:http/TCP:40001/40002"}},
		{"a bind-mode snapshot (service ports) does not", bindSnap, v4, false, nil},
		{"a dual-stack node does not (the snapshot has no families)", iptablesSnap, []portal.Family{portal.IPv4, portal.IPv6}, false, nil},
		{"a node with bind mode's portal link does not", iptablesSnap, v4, true, nil},
		{"no snapshot", nil, v4, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seeds, ok := snapshotSeeds(tc.st, tc.fams, inRange, tc.bindLink)
			var got []string
			for _, s := range seeds {
				if len(s.Families) != 1 || s.Families[0] != portal.IPv4 {
					t.Errorf("%s listens in %v, want IPv4", s.Name, s.Families)
				}
				got = append(got, fmt.Sprintf("%s/%s:%d/%d", s.Name, s.Protocol, s.ProxyPort, s.ExternalProxyPort))
			}
			if ok != (tc.want != nil) || !slices.Equal(got, tc.want) {
				t.Errorf("seeds %v (ok %v), want %v", got, ok, tc.want)
			}
		})
	}
}

// steeredTestMode is the harness's portal mode with rules of a previous process in force:
// Steered returns seeds.
type steeredTestMode struct {
	*testMode
	seeds []proxier.Seed
}

func (m *steeredTestMode) Steered(context.Context) ([]proxier.Seed, error) { return m.seeds, nil }

// TestSourcesStartOnceTheReopenServes: after a crash the sources (whose initial lists take
// seconds of CPU at 10,000 Services) start only once the reopened proxy sockets serve, so that
// the reopen has the CPUs to itself. The test holds the seed's proxy port (127.0.0.1, from
// --proxy-port-range) so that the reopen waits on the fake clock, and watches the Services list.
func TestSourcesStartOnceTheReopenServes(t *testing.T) {
	hold, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	port := netip.MustParseAddrPort(hold.Addr().String()).Port()

	client := fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Status: v1.NodeStatus{Addresses: []v1.NodeAddress{
		{Type: v1.NodeInternalIP, Address: "192.0.2.10"}}}})
	var listed atomic.Bool
	client.PrependReactor("list", "services", func(k8stesting.Action) (bool, k8sruntime.Object, error) {
		listed.Store(true)
		return false, nil, nil
	})
	h := newHarness(t, "--hostname-override=node-1", fmt.Sprintf("--proxy-port-range=%d", port),
		"--healthz-bind-address=", "--metrics-bind-address=")
	h.d.deps.client = func(*Options, string) (kubernetes.Interface, error) { return client, nil }
	portals := h.d.deps.portals
	h.d.deps.portals = func(ctx context.Context, o *Options, hostIPs map[portal.Family]netip.Addr, ev *serviceEvents, inh *handover.Inherited, log logrus.FieldLogger) (portalMode, error) {
		pm, err := portals(ctx, o, hostIPs, ev, inh, log)
		if err != nil {
			return nil, err
		}
		return &steeredTestMode{testMode: pm.(*testMode), seeds: []proxier.Seed{{Name: service.ServicePortName{Namespace: "default", Name: "echo", Port: "tcp"},
			Protocol: service.TCP, ProxyPort: port, Families: []portal.Family{portal.IPv4}}}}, nil
	}
	h.start(t)

	// The reopen retries the port in use on the fake clock; the sources must not list meanwhile
	// (they did at once, beside the reopen, before the fix).
	testenv.WaitFor(t, "the reopen to retry the port in use", h.clk.HasWaiters)
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		if listed.Load() {
			t.Fatal("the Services were listed while the reopen had not served yet")
		}
		runtime.Gosched()
	}
	hold.Close()
	h.clk.Step(50 * time.Millisecond)
	testenv.WaitFor(t, "the Services to be listed once the reopen serves", listed.Load)
}
