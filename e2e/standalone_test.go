package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// The standalone scenario's manifests: no API server, so the addresses are fixed here.
const (
	fileNamespace = "standalone"
	fileNodePort  = 30080
)

var (
	fileWebIP   = netip.MustParseAddr("10.96.0.10")
	fileAddedIP = netip.MustParseAddr("10.96.0.20")
)

// TestStandaloneServicesFile runs the proxy on --services-file with no API server: the same
// traffic checks as against the API server, then a changed file is picked up (endpoints moved, a
// service added), and a broken file is rejected with the last good state kept serving.
// servicesDir is a directory for --services-file and a write that replaces its services.yaml
// whole: written elsewhere and renamed, so the proxy never reads a half-written file.
func servicesDir(t *testing.T) (dir string, write func(content string)) {
	dir, stage := t.TempDir(), t.TempDir()
	return dir, func(content string) {
		t.Helper()
		tmp := filepath.Join(stage, "services.yaml")
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, "services.yaml")); err != nil {
			t.Fatal(err)
		}
	}
}

func TestStandaloneServicesFile(t *testing.T) {
	t.Parallel()
	bed := newBed(t, 3)
	dir, write := servicesDir(t)
	ext := externalIP()
	write(webManifest(ext, 1, 2, 3))
	proxy := startProxy(t, bed.Node, t.TempDir(), proxyArgs("--services-file="+dir, "--services-file-check-period=200ms")...)

	checkTraffic(t, bed, proxy, targets{
		namespace: fileNamespace,
		// With no Node object the proxy takes the first interface (by name) with a global
		// address: to-client.
		nodeIP:     testbed.NodeClientIP,
		clusterTCP: netip.AddrPortFrom(fileWebIP, 80),
		clusterUDP: netip.AddrPortFrom(fileWebIP, 53),
		nodePort:   netip.AddrPortFrom(testbed.NodeExtIP, fileNodePort),
		externalIP: netip.AddrPortFrom(netip.MustParseAddr(ext), 80),
	}, podNames(1, 2, 3))

	web, added := netip.AddrPortFrom(fileWebIP, 80), netip.AddrPortFrom(fileAddedIP, 80)
	// onlyFrom checks that a few requests in a row are all answered by pod.
	onlyFrom := func(addr netip.AddrPort, pod string) error {
		got := map[string]int{}
		for range 4 {
			who, err := whoTCP(bed.Client, addr)
			if err != nil {
				return fmt.Errorf("%s: %w", addr, err)
			}
			got[who]++
		}
		if got[pod] != 4 {
			return fmt.Errorf("%s answered by %v, want only %s", addr, got, pod)
		}
		return nil
	}
	bothChanged := func() error {
		if err := proxy.exited(); err != nil {
			return err
		}
		if err := onlyFrom(web, "pod2"); err != nil {
			return err
		}
		return onlyFrom(added, "pod3")
	}

	t.Run("a_changed_file_is_reloaded", func(t *testing.T) {
		write(webManifest(ext, 2) + addedManifest(3))
		eventually(t, 15*time.Second, "the changed services file never took effect", bothChanged)
	})
	t.Run("a_broken_file_keeps_the_last_good_state", func(t *testing.T) {
		write(webManifest(ext, 2) + "---\napiVersion: v1\nkind: Service\nmetadata: [not, a, map]\n")
		eventually(t, 15*time.Second, "no rejection of the broken file in the proxy log", func() error {
			if !strings.Contains(proxy.LogTail(1000), "Rejected services file") {
				return fmt.Errorf("no %q line in %s", "Rejected services file", proxy.LogPath)
			}
			return nil
		})
		if err := bothChanged(); err != nil {
			t.Errorf("after the broken file: %v", err)
		}
	})
}

// webManifest is the web service (TCP http 80 -> 8080 with node port fileNodePort, UDP dns
// 53 -> 5353, an external IP) with its endpoints on the given pods.
func webManifest(externalIP string, pods ...int) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: %[1]s
spec:
  type: NodePort
  clusterIP: %[2]s
  externalIPs: [%[3]q]
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: %[4]d}
  - {name: dns, protocol: UDP, port: 53, targetPort: 5353}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: %[1]s
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: http, protocol: TCP, port: 8080}
- {name: dns, protocol: UDP, port: 5353}
endpoints:
%[5]s`, fileNamespace, fileWebIP, externalIP, fileNodePort, endpointsYAML(pods))
}

// addedManifest is a second ClusterIP service with its endpoints on the given pods.
func addedManifest(pods ...int) string {
	return fmt.Sprintf(`---
apiVersion: v1
kind: Service
metadata:
  name: added
  namespace: %[1]s
spec:
  clusterIP: %[2]s
  ports:
  - {name: http, protocol: TCP, port: 80, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: added-1
  namespace: %[1]s
  labels: {kubernetes.io/service-name: added}
addressType: IPv4
ports:
- {name: http, protocol: TCP, port: 8080}
endpoints:
%[3]s`, fileNamespace, fileAddedIP, endpointsYAML(pods))
}

func endpointsYAML(pods []int) string {
	var b strings.Builder
	for _, i := range pods {
		fmt.Fprintf(&b, "- addresses: [%q]\n  conditions: {ready: true}\n", testbed.PodIP(i))
	}
	return b.String()
}
