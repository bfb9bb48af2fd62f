package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

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
	eventually(t, 30*time.Second, "the cluster IP never answered in bind mode", func() error {
		if err := proxy.exited(); err != nil {
			return err
		}
		_, err := whoTCP(bed.Client, web)
		return err
	})

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
