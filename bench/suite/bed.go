package main

// bed.go builds the namespaces of one measurement with internal/testbed: client -> node -> pod,
// the backend child in the pod. Each (round, target) gets a fresh bed, so no target inherits
// another's TIME_WAIT sockets, conntrack entries or rules.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// bed is one set of namespaces with the backend running in the pod.
type bed struct {
	lab     *netns.Lab
	tb      *testbed.Bed
	backend *child
	servers []*child // the real servers (redis-server, unbound), when the real clients run
	dir     string   // scratch files of the targets
}

// podAddr is the pod's address for port.
func podAddr(port uint16) netip.AddrPort { return netip.AddrPortFrom(testbed.PodIP(1), port) }

// nsSysctls are set inside the bed's namespaces, never in the root one: the node forwards (the
// direct path is routed through it, as pod traffic is), and the client and node may reuse
// TIME_WAIT ports for the connection-rate test.
var nsSysctls = map[string][]string{
	"node":   {"net.ipv4.ip_forward=1", "net.ipv4.tcp_tw_reuse=1", "net.ipv4.ip_local_port_range=1024 65000"},
	"client": {"net.ipv4.tcp_tw_reuse=1", "net.ipv4.ip_local_port_range=1024 65000"},
}

// newBed builds the namespaces and starts the backend; real adds redis-server and unbound.
func newBed(ctx context.Context, real bool) (_ *bed, err error) {
	lab, err := netns.NewLab()
	if err != nil {
		return nil, err
	}
	b := &bed{lab: lab}
	defer func() {
		if err != nil {
			b.close()
		}
	}()
	if b.dir, err = os.MkdirTemp("", lab.Prefix()); err != nil {
		return nil, err
	}
	if b.tb, err = testbed.New(ctx, lab, 1); err != nil {
		return nil, err
	}
	for role, ns := range map[string]*netns.NS{"node": b.tb.Node, "client": b.tb.Client} {
		for _, kv := range nsSysctls[role] {
			if _, err := ns.Exec(ctx, "sysctl", "-q", "-w", kv); err != nil {
				return nil, fmt.Errorf("bed: %s sysctl %s: %w", ns.Name, kv, err)
			}
		}
	}
	if b.backend, err = startSelf(ctx, b.tb.Pods[0].NS, "backend"); err != nil {
		return nil, err
	}
	if l, err := b.backend.line(); err != nil || l != "ready" {
		return nil, fmt.Errorf("bed: backend did not start: %q %v", l, err)
	}
	if real {
		if err := b.startRealServers(ctx); err != nil {
			return nil, fmt.Errorf("bed: %w", err)
		}
	}
	return b, nil
}

func (b *bed) close() error {
	if b.backend != nil {
		b.backend.stop(syscall.SIGTERM, 5*time.Second)
	}
	for _, s := range b.servers {
		s.stop(syscall.SIGTERM, 5*time.Second)
	}
	if b.dir != "" {
		os.RemoveAll(b.dir)
	}
	return b.lab.Close()
}

// probeTCP waits until an echo exchange through addr works from the client namespace.
func (b *bed) probeTCP(ctx context.Context, addr netip.AddrPort, exited <-chan struct{}) error {
	return b.probe(ctx, exited, func() error {
		c, err := testbed.Dial(b.tb.Client, addr, 300*time.Millisecond)
		if err != nil {
			return err
		}
		defer c.Close()
		return exchange(c, "probe")
	})
}

// halfClose reports whether a reply sent after the client's FIN comes back through addr (the
// sink acks at EOF): a proxy that closes both sides at the first EOF fails it.
func (b *bed) halfClose(addr netip.AddrPort) bool {
	c, err := testbed.Dial(b.tb.Client, addr, time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return false
	}
	tc, ok := c.(*net.TCPConn)
	if !ok || tc.CloseWrite() != nil {
		return false
	}
	ack := make([]byte, 1)
	_, err = io.ReadFull(c, ack)
	return err == nil
}

// probeUDP waits until a datagram through addr is echoed back to the client namespace.
func (b *bed) probeUDP(ctx context.Context, addr netip.AddrPort, exited <-chan struct{}) error {
	return b.probe(ctx, exited, func() error {
		var c net.Conn
		if err := b.tb.Client.Do(func() (err error) { c, err = net.Dial("udp4", addr.String()); return err }); err != nil {
			return err
		}
		defer c.Close()
		return exchange(c, "probe")
	})
}

func (b *bed) probe(ctx context.Context, exited <-chan struct{}, try func() error) error {
	return testbed.Eventually(ctx, 20*time.Second, 50*time.Millisecond, func() error {
		select {
		case <-exited:
			return errors.New("the proxy exited")
		default:
		}
		return try()
	})
}

// exchange sends msg and expects it back within 300 ms.
func exchange(c net.Conn, msg string) error {
	_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != msg {
		return fmt.Errorf("echo %q, want %q", buf, msg)
	}
	return nil
}
