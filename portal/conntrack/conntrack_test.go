package conntrack

import (
	"context"
	"net"
	"net/netip"
	"reflect"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: cluster IPs 10.96.0.10 and fd00::a, external IP 192.0.2.7, load-balancer IP
// 198.51.100.1, node 192.168.1.10; DNS on port 53, node port 30053.

func TestFlowsOf_allAddressesOfThePort(t *testing.T) {
	p := &service.Port{
		Protocol:        service.UDP,
		Port:            53,
		NodePort:        30053,
		ClusterIPs:      []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00::a")},
		ExternalIPs:     []netip.Addr{netip.MustParseAddr("192.0.2.7")},
		LoadBalancerIPs: []netip.Addr{netip.MustParseAddr("198.51.100.1"), netip.MustParseAddr("192.0.2.7")},
	}
	want := Flows{
		Addrs: []netip.Addr{netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("192.0.2.7"),
			netip.MustParseAddr("198.51.100.1"), netip.MustParseAddr("fd00::a")},
		Port: 53, NodePort: 30053,
	}
	if got := FlowsOf(p); !reflect.DeepEqual(got, want) {
		t.Errorf("FlowsOf (-want +got):\n-%+v\n+%+v", want, got)
	}
}

// flow is a conntrack entry as the kernel dumps it: protocol, original destination.
func flow(proto uint8, dst string) *netlink.ConntrackFlow {
	ap := netip.MustParseAddrPort(dst)
	fam := uint8(unix.AF_INET)
	if ap.Addr().Is6() {
		fam = unix.AF_INET6
	}
	f := &netlink.ConntrackFlow{FamilyType: fam}
	f.Forward.Protocol = proto
	f.Forward.DstIP = net.IP(ap.Addr().AsSlice())
	f.Forward.DstPort = ap.Port()
	f.Forward.SrcIP = net.IP(netip.MustParseAddr("10.100.0.2").AsSlice())
	if ap.Addr().Is6() {
		f.Forward.SrcIP = net.IP(netip.MustParseAddr("fd00:100::2").AsSlice())
	}
	f.Forward.SrcPort = 40000
	return f
}

// replyFrom sets where f's replies come from: the address its destination was translated to.
func replyVia(f *netlink.ConntrackFlow, src string) *netlink.ConntrackFlow {
	ap := netip.MustParseAddrPort(src)
	f.Reverse.Protocol = f.Forward.Protocol
	f.Reverse.SrcIP, f.Reverse.SrcPort = net.IP(ap.Addr().AsSlice()), ap.Port()
	f.Reverse.DstIP, f.Reverse.DstPort = f.Forward.SrcIP, f.Forward.SrcPort
	return f
}

// TestFilters_deleteExactlyTheFlowsOfThePort checks which entries the filters of a Flows match,
// per family, as ClearUDP hands them to the kernel dump.
func TestFilters_deleteExactlyTheFlowsOfThePort(t *testing.T) {
	v4, v6 := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00::a")
	ext := netip.MustParseAddr("192.0.2.7")
	tests := []struct {
		name    string
		flows   Flows
		deleted []*netlink.ConntrackFlow
		kept    []*netlink.ConntrackFlow
	}{{
		name:  "cluster and external IPs and a node port",
		flows: Flows{Addrs: []netip.Addr{v4, ext}, Port: 53, NodePort: 30053},
		deleted: []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, "10.96.0.10:53"), flow(unix.IPPROTO_UDP, "192.0.2.7:53"),
			flow(unix.IPPROTO_UDP, "192.168.1.10:30053")},
		kept: []*netlink.ConntrackFlow{flow(unix.IPPROTO_TCP, "10.96.0.10:53"), flow(unix.IPPROTO_UDP, "10.96.0.10:54"),
			flow(unix.IPPROTO_UDP, "10.96.0.11:53"), flow(unix.IPPROTO_UDP, "192.168.1.10:53"),
			flow(unix.IPPROTO_TCP, "192.168.1.10:30053"), flow(unix.IPPROTO_UDP, "[fd00::1]:30053")},
	}, {
		name:  "dual stack node port clears both families",
		flows: Flows{Addrs: []netip.Addr{v4, v6}, Port: 53, NodePort: 30053},
		deleted: []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, "10.96.0.10:53"), flow(unix.IPPROTO_UDP, "[fd00::a]:53"),
			flow(unix.IPPROTO_UDP, "192.168.1.10:30053"), flow(unix.IPPROTO_UDP, "[fd00::1]:30053")},
		kept: []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, "[fd00::b]:53")},
	}, {
		name:    "node port alone defaults to IPv4",
		flows:   Flows{NodePort: 30053},
		deleted: []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, "192.168.1.10:30053")},
		kept:    []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, "[fd00::1]:30053")},
	}, {
		// A port that moved to the kernel path (issue 34: the chaos soak lost a DNS answer right
		// after the switch): the entries redirected to its old proxy socket go, the ones its
		// KUBE-SEP DNAT made meanwhile stay, or the endpoint's answer finds no entry to undo it.
		name:  "narrowed to the proxy ports",
		flows: Flows{Addrs: []netip.Addr{v4}, Port: 53, NodePort: 30053, ProxyPorts: []uint16{41234, 41235}},
		deleted: []*netlink.ConntrackFlow{replyVia(flow(unix.IPPROTO_UDP, "10.96.0.10:53"), "192.168.1.10:41234"),
			replyVia(flow(unix.IPPROTO_UDP, "192.168.1.10:30053"), "192.168.1.10:41235")},
		kept: []*netlink.ConntrackFlow{replyVia(flow(unix.IPPROTO_UDP, "10.96.0.10:53"), "10.244.1.10:5353"),
			replyVia(flow(unix.IPPROTO_UDP, "192.168.1.10:30053"), "10.244.2.10:5353")},
	}, {
		// A kernel-path port that lost an endpoint: only the flows DNATed to it go (as
		// kube-proxy's conntrack delete by --dst-nat); those of the endpoints that stay keep
		// their answers in flight.
		name:    "narrowed to the endpoints removed",
		flows:   Flows{Addrs: []netip.Addr{v4}, Port: 53, Endpoints: []netip.AddrPort{netip.MustParseAddrPort("10.244.1.10:5353")}},
		deleted: []*netlink.ConntrackFlow{replyVia(flow(unix.IPPROTO_UDP, "10.96.0.10:53"), "10.244.1.10:5353")},
		kept: []*netlink.ConntrackFlow{replyVia(flow(unix.IPPROTO_UDP, "10.96.0.10:53"), "10.244.2.10:5353"),
			replyVia(flow(unix.IPPROTO_UDP, "10.96.0.10:53"), "10.244.1.10:5354")},
	}, {
		name:    "an IPv4-mapped address counts as IPv4",
		flows:   Flows{Addrs: []netip.Addr{netip.MustParseAddr("::ffff:10.96.0.10")}, Port: 53},
		deleted: []*netlink.ConntrackFlow{flow(unix.IPPROTO_UDP, "10.96.0.10:53")},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			byFamily, err := filters(tt.flows)
			if err != nil {
				t.Fatal(err)
			}
			matches := func(f *netlink.ConntrackFlow) bool {
				for _, cf := range byFamily[netlink.InetFamily(f.FamilyType)] {
					if cf.MatchConntrackFlow(f) {
						return true
					}
				}
				return false
			}
			for _, f := range tt.deleted {
				if !matches(f) {
					t.Errorf("entry to %s:%d (proto %d) is kept, want deleted", f.Forward.DstIP, f.Forward.DstPort, f.Forward.Protocol)
				}
			}
			for _, f := range tt.kept {
				if matches(f) {
					t.Errorf("entry to %s:%d (proto %d) is deleted, want kept", f.Forward.DstIP, f.Forward.DstPort, f.Forward.Protocol)
				}
			}
		})
	}
}

func TestNetlink_ClearUDPWithADoneContextDoesNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	ran := false
	n := &Netlink{Do: func(fn func() error) error { ran = true; return fn() }}
	if err := n.ClearUDP(ctx, Flows{NodePort: 30053}); err == nil || ran {
		t.Errorf("ClearUDP(cancelled) = %v, ran %v; want the context's error and nothing run", err, ran)
	}
}

func TestFake_Dump(t *testing.T) {
	f := &Fake{}
	f.ClearUDP(context.Background(), Flows{Addrs: []netip.Addr{netip.MustParseAddr("fd00::a"),
		netip.MustParseAddr("10.96.0.10")}, Port: 53, NodePort: 30053})
	want := "udp 10.96.0.10:53\nudp [fd00::a]:53\nudp nodeport 30053"
	if got := f.Dump(); got != want {
		t.Errorf("Dump() (-want +got):\n-%s\n+%s", want, got)
	}
}
