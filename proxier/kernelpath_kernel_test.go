package proxier

// Address plan: one namespace, node, with no interface but lo; nothing is sent. Service ns/web
// (cluster IP 10.96.0.10:80, node port 30080) on the kernel path, endpoints 10.244.1.1-2:8080;
// node IP 10.100.0.1 (the portals' DNAT target, unused by the kernel path).

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/loadbalancer"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// ourLines keeps the lines of iptables-save that are about our chains (declarations and rules
// in or into them), without counters.
func ourLines(save string) string {
	var out []string
	for _, l := range strings.Split(save, "\n") {
		if strings.HasPrefix(l, "*") || strings.Contains(l, "KUBE-") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestKernelPathPeriodicSyncRepairsFlushes runs the proxier's own sync loop (the bounded runner,
// --iptables-sync-period 2 s) over real iptables in a throwaway namespace, with a Service on the
// kernel path and the full read-back an hour away, and flushes one kernel-path chain at a time:
// each is back within one sync period (plus the repair's own time), without any Service change
// to trigger a sync. Before
// the canary covered the kernel path, only the read-back (a minute, here an hour) repaired them.
func TestKernelPathPeriodicSyncRepairsFlushes(t *testing.T) {
	const syncPeriod = 2 * time.Second
	// repairTime bounds one repair's own work (the read-back and a restore) on a loaded machine.
	const repairTime = 1500 * time.Millisecond
	lab := netns.NewTestLab(t)
	node := lab.MustAdd(t, "node")
	rules := iptables.New(iptables.Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: netip.MustParseAddr("10.100.0.1")},
		KernelPath: true, PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}, VerifyPeriod: time.Hour},
		&iptables.ExecRunner{Prefix: node.CommandPrefix()})
	p := New(Config{MinSyncPeriod: 100 * time.Millisecond, SyncPeriod: syncPeriod, KernelPath: true},
		Deps{Balancer: loadbalancer.New(clock.RealClock{}), Portals: rules,
			Sockets: func(port *service.Port, _ Picker, _ func(netip.Addr) bool) ProxySocket {
				t.Errorf("a proxy socket for %s: every port here is on the kernel path", port.Name)
				return nil
			}})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = rules.Cleanup(context.Background())
	})

	p.OnServiceAdd(webService(func(s *v1.Service) {
		withDataPath("kernel")(s)
		s.Spec.Type = v1.ServiceTypeNodePort
		s.Spec.Ports[0].NodePort = 30080
	}))
	p.OnEndpointSliceAdd(webSlice("a", 8080, "10.244.1.1", "10.244.1.2"))
	p.OnServicesSynced()
	p.OnEndpointSlicesSynced()
	p.Sync()

	svc := kernel.ServiceChain(kernel.PrefixService, webHTTP, service.TCP)
	sep := kernel.EndpointChain(webHTTP, service.TCP, "10.244.1.1:8080")
	save := func() string {
		t.Helper()
		return ourLines(node.MustExec(t, "iptables-save"))
	}
	testenv.WaitForEvery(t, 10*time.Second, 20*time.Millisecond, "the kernel chains of "+webHTTP.String(), func() bool {
		return strings.Contains(save(), "-A "+sep+" ")
	})
	want := save()
	for _, chain := range []string{kernel.ChainServices, kernel.ChainNodePorts, kernel.ChainMarkMasq, kernel.ChainPostrouting, svc, sep} {
		t.Run(chain, func(t *testing.T) {
			node.MustExec(t, "iptables", "-w", "5", "-t", "nat", "-F", chain)
			if save() == want {
				t.Fatalf("flushing %s changed nothing", chain)
			}
			start := time.Now()
			// Repaired by the next periodic sync: within one sync period of the flush, plus the
			// repair's own time.
			testenv.WaitForEvery(t, syncPeriod+repairTime, 20*time.Millisecond, chain+" repaired by the periodic sync", func() bool { return save() == want })
			t.Logf("%s repaired %v after the flush", chain, time.Since(start).Round(time.Millisecond))
		})
	}
	if st := rules.Stats(); st.Repairs < 6 {
		t.Errorf("Stats().Repairs = %d, want one per flush (6)", st.Repairs)
	}
}
