package bind

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// BenchmarkPortalConnect measures what a portal costs per connection, iptables and bind in the
// same run: a client namespace connects to cluster IP 10.96.0.10:80 via the node, reads one byte
// and closes. iptables: a REDIRECT rule sends it to a listener on :34001 (NAT, and conntrack
// for every packet). bind: the listener is on 10.96.0.10:80 itself. Each mode gets its own
// testbed, so conntrack runs only where NAT does. No proxying: this is the portal alone.
//
//	go test -run XXX -bench BenchmarkPortalConnect -benchtime 3000x ./portal/bind/
func BenchmarkPortalConnect(b *testing.B) {
	vip := netip.AddrPortFrom(netip.MustParseAddr("10.96.0.10"), 80)
	spec := portal.Spec{Name: spn("bench", "web", ""), Protocol: service.TCP, Port: 80,
		ClusterIPs: []netip.Addr{vip.Addr()}, ProxyPort: 34001}

	b.Run("iptables", func(b *testing.B) {
		bed := newBenchBed(b)
		serveOneByte(b, bed.Node, netip.AddrPortFrom(netip.IPv4Unspecified(), spec.ProxyPort))
		p := iptables.New(iptables.Config{HostIPs: map[portal.Family]netip.Addr{portal.IPv4: testbed.NodeClientIP}},
			&iptables.ExecRunner{Prefix: bed.Node.CommandPrefix()})
		if err := p.Sync(b.Context(), []portal.Spec{spec}); err != nil {
			b.Fatal(err)
		}
		connectLoop(b, bed.Client, vip)
	})
	b.Run("bind", func(b *testing.B) {
		bed := newBenchBed(b)
		serveOneByte(b, bed.Node, vip)
		nl := &Netlink{Do: bed.Node.Do}
		b.Cleanup(func() { nl.Close() })
		logger, _ := quietLogger()
		if err := New(Config{Logger: logger}, nl).Sync(b.Context(), []portal.Spec{spec}); err != nil {
			b.Fatal(err)
		}
		connectLoop(b, bed.Client, vip)
	})
}

func newBenchBed(b *testing.B) *testbed.Bed {
	b.Helper()
	bed, err := testbed.New(b.Context(), netns.NewTestLab(b), 0)
	if err != nil {
		b.Fatal(err)
	}
	return bed
}

// serveOneByte accepts on addr inside ns (IP_FREEBIND, so before the address exists), writes one
// byte and closes, so the server side holds the TIME_WAIT.
func serveOneByte(b *testing.B, ns *netns.NS, addr netip.AddrPort) {
	b.Helper()
	lc := net.ListenConfig{Control: freebind}
	var ln net.Listener
	if err := ns.Do(func() error {
		var err error
		ln, err = lc.Listen(b.Context(), "tcp", addr.String())
		return err
	}); err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	b.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte{1})
			c.Close()
		}
	})
}

// connectLoop runs b.N connect-read-close rounds from a thread inside the client namespace.
func connectLoop(b *testing.B, client *netns.NS, addr netip.AddrPort) {
	b.Helper()
	d := net.Dialer{Timeout: 2 * time.Second}
	err := client.Do(func() error {
		buf := make([]byte, 1)
		b.ResetTimer()
		for i := range b.N {
			c, err := d.Dial("tcp", addr.String())
			if err != nil {
				return fmt.Errorf("connection %d: %w", i, err)
			}
			_, err = io.ReadFull(c, buf)
			c.Close()
			if err != nil {
				return fmt.Errorf("connection %d: read: %w", i, err)
			}
		}
		b.StopTimer()
		return nil
	})
	if err != nil && !errors.Is(err, net.ErrClosed) {
		b.Fatal(err)
	}
}
