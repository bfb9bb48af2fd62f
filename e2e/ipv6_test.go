package e2e

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// IPv6 address plan (all inside the test's namespaces, fd00::/8):
//
//	client  fd00:30::2/64      <-> node fd00:30::1/64 (to-client); the client routes everything via the node
//	ext     fd00:192::2/64     <-> node fd00:192::1/64 (to-ext); node port 30080 is reached here;
//	                               ext routes the cluster range fd00:96::/112 and the external
//	                               range fd00:203::/64 via the node
//	pod1    fd00:244:1::10/64  <-> node fd00:244:1::1/64 (to-pod1); TCP 8080 greets "pod1",
//	                               UDP 5353 answers "pod1 <payload>"
//	cluster IP fd00:96::10, external IP fd00:203::10, both on port 80 (TCP) and 53 (UDP);
//	node ports 30080 (TCP) and 30053 (UDP); cluster IP fd00:96::20 (service empty6, no endpoints)
var (
	v6NodeClient = netip.MustParseAddr("fd00:30::1")
	v6Client     = netip.MustParseAddr("fd00:30::2")
	v6NodeExt    = netip.MustParseAddr("fd00:192::1")
	v6Ext        = netip.MustParseAddr("fd00:192::2")
	v6NodePod    = netip.MustParseAddr("fd00:244:1::1")
	v6Pod        = netip.MustParseAddr("fd00:244:1::10")
	v6ClusterIP  = netip.MustParseAddr("fd00:96::10")
	v6ExternalIP = netip.MustParseAddr("fd00:203::10")
	v6EmptyIP    = netip.MustParseAddr("fd00:96::20")
)

const (
	v6NodePort    = 30080
	v6NodePortUDP = 30053
)

type v6Bed struct {
	node, client, ext, pod *netns.NS
}

// newV6Bed builds the IPv6 namespaces and starts pod1's backends. IPv6 missing on this machine
// skips the test, or fails it under KPP_E2E_REQUIRE.
func newV6Bed(t *testing.T) *v6Bed {
	t.Helper()
	requireRoot(t)
	if _, err := os.Stat("/proc/sys/net/ipv6"); err != nil {
		testenv.Unavailable(t, "no IPv6 in this kernel: %v", err)
	}
	lab := netns.NewTestLab(t)
	ctx := t.Context()
	b := &v6Bed{node: lab.MustAdd(t, "node"), client: lab.MustAdd(t, "client"), ext: lab.MustAdd(t, "ext"), pod: lab.MustAdd(t, "pod1")}
	p64 := func(a netip.Addr) netip.Prefix { return netip.PrefixFrom(a, 64) }
	steps := []func() error{
		func() error {
			return netns.Link(ctx, netns.End{NS: b.node, Dev: "to-client", Addr: p64(v6NodeClient)}, netns.End{NS: b.client, Dev: "eth0", Addr: p64(v6Client)})
		},
		func() error {
			return netns.Link(ctx, netns.End{NS: b.node, Dev: "to-ext", Addr: p64(v6NodeExt)}, netns.End{NS: b.ext, Dev: "eth0", Addr: p64(v6Ext)})
		},
		func() error {
			return netns.Link(ctx, netns.End{NS: b.node, Dev: "to-pod1", Addr: p64(v6NodePod)}, netns.End{NS: b.pod, Dev: "eth0", Addr: p64(v6Pod)})
		},
		func() error { return b.client.AddRoute(ctx, netip.MustParsePrefix("::/0"), v6NodeClient, "eth0") },
		func() error { return b.ext.AddRoute(ctx, netip.MustParsePrefix("fd00:96::/112"), v6NodeExt, "eth0") },
		func() error { return b.ext.AddRoute(ctx, netip.MustParsePrefix("fd00:203::/64"), v6NodeExt, "eth0") },
		func() error { return b.pod.AddRoute(ctx, netip.MustParsePrefix("::/0"), v6NodePod, "eth0") },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			testenv.Unavailable(t, "IPv6 test namespaces: %v", err)
		}
	}
	serveV6(t, b.pod, "pod1")
	return b
}

// serveV6 runs pod backends on IPv6 in ns, as testbed's pods do on IPv4: TCP 8080 greets with the
// name and echoes, UDP 5353 answers "<name> <datagram>".
func serveV6(t *testing.T, ns *netns.NS, name string) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	if err := ns.Do(func() error {
		var err error
		if ln, err = net.Listen("tcp6", "[::]:8080"); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp6", "[::]:5353")
		return err
	}); err != nil {
		if ln != nil {
			ln.Close()
		}
		testenv.Unavailable(t, "IPv6 backend in %s: %v", ns.Name, err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) {
		fmt.Fprintf(c, "%s\n", name)
		buf := make([]byte, 1024)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			if _, err := c.Write(buf[:n]); err != nil {
				return
			}
		}
	})
	var wg sync.WaitGroup
	t.Cleanup(func() { pc.Close(); wg.Wait() })
	wg.Go(func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(append([]byte(name+" "), buf[:n]...), from)
		}
	})
}

func v6Manifest() string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: web6
  namespace: %[1]s
spec:
  type: NodePort
  ipFamilies: [IPv6]
  clusterIP: %[2]s
  clusterIPs: [%[2]q]
  externalIPs: [%[3]q]
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: %[4]d}
  - {name: dns, protocol: UDP, port: 53, targetPort: 5353, nodePort: %[6]d}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web6-1
  namespace: %[1]s
  labels: {kubernetes.io/service-name: web6}
addressType: IPv6
ports:
- {name: http, protocol: TCP, port: 8080}
- {name: dns, protocol: UDP, port: 5353}
endpoints:
- addresses: [%[5]q]
  conditions: {ready: true}
---
apiVersion: v1
kind: Service
metadata:
  name: empty6
  namespace: %[1]s
spec:
  ipFamilies: [IPv6]
  clusterIP: %[7]s
  clusterIPs: [%[7]q]
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080}
  - {name: dns, protocol: UDP, port: 53, targetPort: 5353}
`, fileNamespace, v6ClusterIP, v6ExternalIP, v6NodePort, v6Pod, v6NodePortUDP, v6EmptyIP)
}

// TestIPv6TrafficThroughEveryPortal sends real IPv6 traffic through the real proxy, in iptables
// mode and in bind mode: TCP and UDP from a pod to the cluster IP and from an external host to the
// node port and to the external IP, each answered by the pod behind them. In bind mode, a service
// without endpoints is refused over IPv6 too (TCP reset, ICMPv6 port unreachable).
func TestIPv6TrafficThroughEveryPortal(t *testing.T) {
	t.Parallel()
	for _, mode := range []struct {
		name string
		args []string
	}{
		{"iptables", nil},
		{"bind", []string{"--portal-mode=bind", "--portal-interface=kpp-svc6"}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			b := newV6Bed(t)
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, "services.yaml"), []byte(v6Manifest()), 0o644); err != nil {
				t.Fatal(err)
			}
			proxy := startProxy(t, b.node, t.TempDir(), proxyArgs(append(mode.args, "--services-file="+dir)...)...)
			cluster := netip.AddrPortFrom(v6ClusterIP, 80)
			proxy.waitAnswers(t, b.client, cluster, "the IPv6 cluster IP never answered")
			for _, c := range []struct {
				name string
				from *netns.NS
				addr netip.AddrPort
				ask  func(*netns.NS, netip.AddrPort) (string, error)
			}{
				{"TCP_cluster_IP_from_a_pod", b.client, cluster, whoTCP},
				{"TCP_node_port_from_the_external_host", b.ext, netip.AddrPortFrom(v6NodeExt, v6NodePort), whoTCP},
				{"TCP_external_IP_from_the_external_host", b.ext, netip.AddrPortFrom(v6ExternalIP, 80), whoTCP},
				{"UDP_cluster_IP_from_a_pod", b.client, netip.AddrPortFrom(v6ClusterIP, 53), whoUDP},
				{"UDP_node_port_from_the_external_host", b.ext, netip.AddrPortFrom(v6NodeExt, v6NodePortUDP), whoUDP},
				{"UDP_external_IP_from_the_external_host", b.ext, netip.AddrPortFrom(v6ExternalIP, 53), whoUDP},
			} {
				t.Run(c.name, func(t *testing.T) {
					for i := range 3 {
						if who, err := c.ask(c.from, c.addr); err != nil || who != "pod1" {
							t.Fatalf("request %d from %s to %s: %q, %v; want pod1", i+1, c.from.Name, c.addr, who, err)
						}
					}
				})
			}
			if mode.name == "bind" {
				t.Run("no_endpoints_refused_by_the_kernel", func(t *testing.T) {
					if who, err := whoTCP(b.client, netip.AddrPortFrom(v6EmptyIP, 80)); !errors.Is(err, syscall.ECONNREFUSED) {
						t.Errorf("TCP [%s]:80 without endpoints: %q, %v; want ECONNREFUSED", v6EmptyIP, who, err)
					}
					if err := udpRefusedFrom(b.client, netip.AddrPortFrom(v6EmptyIP, 53)); err != nil {
						t.Error(err)
					}
				})
			}
		})
	}
}
