package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// TestBindModeWithoutNAT runs the real proxy with --portal-mode=bind on the standalone manifests:
// the service IPs go on the portal interface and the sockets listen on them, so pods, the node,
// the external host (node port, external IP) and UDP all reach the backends while the node
// namespace's nat table stays empty. Changing the file adds and removes exactly the right
// addresses, and --cleanup removes the interface.
func TestBindModeWithoutNAT(t *testing.T) {
	t.Parallel()
	bed := newBed(t, 3)
	dir := t.TempDir()
	ext := externalIP()
	manifests := filepath.Join(dir, "services.yaml")
	if err := os.WriteFile(manifests, []byte(webManifest(ext, 1, 2, 3)+addedManifest(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, bed.Node, t.TempDir(), proxyArgs("--portal-mode=bind", "--portal-interface=kpp-svc",
		"--services-file="+dir, "--services-file-check-period=200ms")...)
	pods := podNames(1, 2, 3)
	web := netip.AddrPortFrom(fileWebIP, 80)
	proxy.waitAnswers(t, bed.Client, web, "the cluster IP never answered in bind mode")

	for _, c := range []struct {
		name string
		from string
		addr netip.AddrPort
	}{
		{"cluster_IP_from_a_pod", "client", web},
		{"cluster_IP_from_the_node", "node", web},
		{"node_port_from_the_external_host", "ext", netip.AddrPortFrom(testbed.NodeExtIP, fileNodePort)},
		{"external_IP_from_the_external_host", "ext", netip.AddrPortFrom(netip.MustParseAddr(ext), 80)},
	} {
		t.Run(c.name, func(t *testing.T) {
			from := bed.Client
			switch c.from {
			case "node":
				from = bed.Node
			case "ext":
				from = bed.External
			}
			if got := keys(tally(t, whoTCP, from, c.addr, 6)); !cmp.Equal(pods, got) {
				t.Errorf("pods answering %s (-want +got):\n%s", c.addr, cmp.Diff(pods, got))
			}
		})
	}
	t.Run("UDP_from_a_pod", func(t *testing.T) {
		if got := keys(tallyUDP(t, bed.Client, netip.AddrPortFrom(fileWebIP, 53), 6)); !cmp.Equal(pods, got) {
			t.Errorf("pods answering UDP (-want +got):\n%s", cmp.Diff(pods, got))
		}
	})
	t.Run("nat_table_stays_empty", func(t *testing.T) {
		out, err := bed.Node.Exec(t.Context(), "iptables-save", "-t", "nat")
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(line, "-A") || strings.Contains(line, "KUBE-") {
				t.Errorf("nat table has %q in bind mode", line)
			}
		}
	})

	addrs := func() []string {
		out, err := bed.Node.Exec(t.Context(), "ip", "-o", "addr", "show", "dev", "kpp-svc")
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, f := range strings.Split(string(out), "\n") {
			fields := strings.Fields(f)
			if len(fields) > 3 && fields[2] == "inet" {
				got = append(got, fields[3])
			}
		}
		return got
	}
	if got, want := addrs(), []string{"10.96.0.10/32", "10.96.0.20/32", ext + "/32"}; !sameSet(got, want) {
		t.Errorf("portal interface addresses = %v, want %v", got, want)
	}
	t.Run("removing_a_service_removes_its_address", func(t *testing.T) {
		if err := os.WriteFile(manifests, []byte(webManifest(ext, 1, 2, 3)), 0o644); err != nil {
			t.Fatal(err)
		}
		eventually(t, 15*time.Second, "the removed service's address stayed", func() error {
			if got, want := addrs(), []string{"10.96.0.10/32", ext + "/32"}; !sameSet(got, want) {
				return fmt.Errorf("addresses %v, want %v", got, want)
			}
			return nil
		})
		if _, err := whoTCP(bed.Client, web); err != nil {
			t.Errorf("the remaining service stopped answering: %v", err)
		}
	})
	t.Run("cleanup_removes_the_interface", func(t *testing.T) {
		if err := proxy.stop(); err != nil {
			t.Fatal(err)
		}
		if out, err := runProxyOnce(t, bed.Node, "--cleanup", "--portal-interface=kpp-svc"); err != nil {
			t.Fatalf("--cleanup: %v\n%s", err, out)
		}
		if out, err := bed.Node.Exec(t.Context(), "ip", "link", "show", "kpp-svc"); err == nil {
			t.Errorf("kpp-svc still exists after --cleanup:\n%s", out)
		}
	})
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// Bind-mode refusal and source-range scenario: addresses in the standalone plan (see
// standalone_test.go), plus the "empty" service 10.96.0.30 (TCP 80, UDP 53) and the "lb" service
// 10.96.0.40 with a load-balancer IP from testbed.ExternalRange, node port 30090 and
// loadBalancerSourceRanges 192.0.2.0/24, which admits the external host (192.0.2.2) and not the
// client pod (172.30.0.2).
var (
	bindEmptyIP = netip.MustParseAddr("10.96.0.30")
	bindLBIP    = netip.MustParseAddr("10.96.0.40")
)

const bindLBNodePort = 30090

// emptyManifest is a ClusterIP service (TCP 80 -> 8080, UDP 53 -> 5353) with endpoints on pods,
// which may be none.
func emptyManifest(pods ...int) string {
	return fmt.Sprintf(`---
apiVersion: v1
kind: Service
metadata:
  name: empty
  namespace: %[1]s
spec:
  clusterIP: %[2]s
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080}
  - {name: dns, protocol: UDP, port: 53, targetPort: 5353}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: empty-1
  namespace: %[1]s
  labels: {kubernetes.io/service-name: empty}
addressType: IPv4
ports:
- {name: http, protocol: TCP, port: 8080}
- {name: dns, protocol: UDP, port: 5353}
endpoints:
%[3]s`, fileNamespace, bindEmptyIP, endpointsYAML(pods))
}

// lbManifest is a LoadBalancer service with source ranges, endpoints on pod 1.
func lbManifest(lbIP string) string {
	return fmt.Sprintf(`---
apiVersion: v1
kind: Service
metadata:
  name: lb
  namespace: %[1]s
spec:
  type: LoadBalancer
  clusterIP: %[2]s
  loadBalancerSourceRanges: ["192.0.2.0/24"]
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: %[4]d}
  - {name: dns, protocol: UDP, port: 53, targetPort: 5353, nodePort: %[4]d}
status:
  loadBalancer:
    ingress: [{ip: %[3]q}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lb-1
  namespace: %[1]s
  labels: {kubernetes.io/service-name: lb}
addressType: IPv4
ports:
- {name: http, protocol: TCP, port: 8080}
- {name: dns, protocol: UDP, port: 5353}
endpoints:
%[5]s`, fileNamespace, bindLBIP, lbIP, bindLBNodePort, endpointsYAML([]int{1}))
}

// udpRefusedFrom sends one datagram from ns to addr on a connected socket and reports whether the
// answer was ICMP port unreachable (ECONNREFUSED on the read).
func udpRefusedFrom(ns *netns.NS, addr netip.AddrPort) error {
	return ns.Do(func() error {
		c, err := net.Dial("udp", addr.String())
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := c.Write([]byte("who")); err != nil {
			return err
		}
		_ = c.SetReadDeadline(time.Now().Add(requestTimeout))
		n, err := c.Read(make([]byte, 512))
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil
		}
		return fmt.Errorf("UDP %s: read %d bytes, %v; want ECONNREFUSED (ICMP port unreachable)", addr, n, err)
	})
}

// scrape returns the value of one series of the proxy's /metrics in ns.
func scrape(ns *netns.NS, series string) (float64, error) {
	code, body, err := httpGet(ns, "http://"+metricsAddr+"/metrics")
	if err != nil || code != 200 {
		return 0, fmt.Errorf("GET /metrics: %d, %v", code, err)
	}
	v, ok := metricValue(body, series)
	if !ok {
		return 0, fmt.Errorf("no %s in /metrics", series)
	}
	return v, nil
}

// TestBindModeRefusesWithoutEndpointsAndChecksSourceRanges runs the real proxy in bind mode: a
// service port without endpoints is refused by the kernel at once (TCP connect ECONNREFUSED, UDP
// ICMP port unreachable), serves as soon as an endpoint appears and then loses no connection, and
// is refused again when the endpoints go while an established connection keeps working. A
// load-balancer IP with loadBalancerSourceRanges serves the admitted client and resets (TCP) or
// ignores (UDP) the other, whose traffic to the cluster IP and node port stays admitted.
func TestBindModeRefusesWithoutEndpointsAndChecksSourceRanges(t *testing.T) {
	t.Parallel()
	bed := newBed(t, 1)
	dir, write := servicesDir(t)
	lbIP := externalIP()
	write(emptyManifest() + lbManifest(lbIP))
	proxy := startProxy(t, bed.Node, t.TempDir(), proxyArgs("--portal-mode=bind", "--portal-interface=kpp-svc",
		"--services-file="+dir, "--services-file-check-period=200ms")...)
	emptyTCP, emptyUDP := netip.AddrPortFrom(bindEmptyIP, 80), netip.AddrPortFrom(bindEmptyIP, 53)
	lbTCP, lbUDP := netip.AddrPortFrom(netip.MustParseAddr(lbIP), 80), netip.AddrPortFrom(netip.MustParseAddr(lbIP), 53)
	proxy.waitAnswers(t, bed.External, lbTCP, "the load-balancer IP never answered the admitted client")

	refused := func(t *testing.T) {
		t.Helper()
		start := time.Now()
		_, err := whoTCP(bed.Client, emptyTCP)
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("TCP %s without endpoints: %v, want ECONNREFUSED", emptyTCP, err)
		} else if d := time.Since(start); d > time.Second {
			t.Errorf("TCP %s refused after %v, want at once", emptyTCP, d)
		}
		if err := udpRefusedFrom(bed.Client, emptyUDP); err != nil {
			t.Error(err)
		}
	}
	t.Run("no_endpoints_is_refused_by_the_kernel", func(t *testing.T) {
		refused(t)
		if v, err := scrape(bed.Node, `kube_portal_proxy_refused_service_ports{traffic="cluster"}`); err != nil || v != 2 {
			t.Errorf("refused cluster service ports = %v, %v; want 2 (empty's TCP and UDP ports)", v, err)
		}
	})

	var kept net.Conn
	parent := t
	t.Run("an_endpoint_appears_and_every_connection_is_served", func(t *testing.T) {
		write(emptyManifest(1) + lbManifest(lbIP))
		eventually(t, 15*time.Second, "the service never served once it had an endpoint", func() error {
			_, err := whoTCP(bed.Client, emptyTCP)
			return err
		})
		for i := range 20 { // once back, no new connection is lost
			if who, err := whoTCP(bed.Client, emptyTCP); err != nil || who != "pod1" {
				t.Fatalf("connection %d after the endpoint appeared: %q, %v", i, who, err)
			}
		}
		eventually(t, 5*time.Second, "UDP never served once it had an endpoint", func() error {
			_, err := whoUDP(bed.Client, emptyUDP)
			return err
		})
		var err error
		if kept, err = dialTCP(bed.Client, emptyTCP); err != nil {
			t.Fatal(err)
		}
		parent.Cleanup(func() { kept.Close() }) // the next step uses it
		if _, err := bufio.NewReader(kept).ReadString('\n'); err != nil {
			t.Fatalf("greeting on the kept connection: %v", err)
		}
	})

	t.Run("endpoints_gone_refused_again_established_connection_kept", func(t *testing.T) {
		if kept == nil {
			t.Skip("no kept connection (previous step failed)")
		}
		write(emptyManifest() + lbManifest(lbIP))
		eventually(t, 15*time.Second, "the service was never refused again", func() error {
			if _, err := whoTCP(bed.Client, emptyTCP); !errors.Is(err, syscall.ECONNREFUSED) {
				return fmt.Errorf("TCP %s: %v, want ECONNREFUSED", emptyTCP, err)
			}
			return nil
		})
		refused(t)
		_ = kept.SetDeadline(time.Now().Add(requestTimeout))
		if _, err := kept.Write([]byte("still\n")); err != nil {
			t.Fatalf("write on the established connection: %v", err)
		}
		if got, err := bufio.NewReader(kept).ReadString('\n'); err != nil || got != "still\n" {
			t.Errorf("echo on the established connection while refusing: %q, %v", got, err)
		}
	})

	t.Run("source_ranges_on_the_load_balancer_IP", func(t *testing.T) {
		if who, err := whoTCP(bed.External, lbTCP); err != nil || who != "pod1" {
			t.Errorf("admitted client (192.0.2.2) to %s: %q, %v", lbTCP, who, err)
		}
		if who, err := whoUDP(bed.External, lbUDP); err != nil || who != "pod1" {
			t.Errorf("admitted client (192.0.2.2) UDP to %s: %q, %v", lbUDP, who, err)
		}
		if who, err := whoTCP(bed.Client, lbTCP); !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("denied client (172.30.0.2) to %s: %q, %v; want the connection reset", lbTCP, who, err)
		}
		if who, err := testbed.WhoUDP(bed.Client, lbUDP, 500*time.Millisecond); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("denied client (172.30.0.2) UDP to %s: %q, %v; want no reply", lbUDP, who, err)
		}
		for _, addr := range []netip.AddrPort{netip.AddrPortFrom(bindLBIP, 80), netip.AddrPortFrom(testbed.NodeClientIP, bindLBNodePort)} {
			if who, err := whoTCP(bed.Client, addr); err != nil || who != "pod1" {
				t.Errorf("the same client to %s (no ranges there): %q, %v", addr, who, err)
			}
		}
		for proto, want := range map[string]float64{"tcp": 1, "udp": 1} {
			series := fmt.Sprintf(`kube_portal_proxy_source_range_drops_total{protocol=%q,service_port="%s/lb:%s"}`, proto, fileNamespace, map[string]string{"tcp": "http", "udp": "dns"}[proto])
			if v, err := scrape(bed.Node, series); err != nil || v != want {
				t.Errorf("%s = %v, %v; want %v", series, v, err, want)
			}
		}
	})
}
