// Package testbed builds a small cluster of network namespaces for the demo and the end-to-end
// tests: a node (where the proxy and its rules run), pods with backends that say who they are, a
// client pod routed via the node, and an external host. The namespaces are linked only to each
// other; nothing touches the root namespace.
package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
)

// The address plan. Cluster IPs (10.96.0.0/16) and external IPs (203.0.113.0/24) exist only as
// portal rules in the node namespace; the client and external host route them to the node.
var (
	ClusterRange  = netip.MustParsePrefix("10.96.0.0/16")
	ExternalRange = netip.MustParsePrefix("203.0.113.0/24")
	NodeClientIP  = netip.MustParseAddr("172.30.0.1")
	ClientIP      = netip.MustParseAddr("172.30.0.2")
	NodeExtIP     = netip.MustParseAddr("192.0.2.1")
	ExternalIP    = netip.MustParseAddr("192.0.2.2")
)

// PodIP is the address of pod i (1-based): 10.244.i.10, with the node at 10.244.i.1.
func PodIP(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(i), 10}) }

func nodePodIP(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(i), 1}) }

// Bed is the set of namespaces.
type Bed struct {
	Lab      *netns.Lab
	Node     *netns.NS
	Client   *netns.NS
	External *netns.NS
	Pods     []*Pod
}

// Pod is a backend namespace.
type Pod struct {
	NS   *netns.NS
	Name string
	IP   netip.Addr
}

// New creates the namespaces and links; pods is how many backend pods.
func New(ctx context.Context, lab *netns.Lab, pods int) (*Bed, error) {
	b := &Bed{Lab: lab}
	if err := b.addNamespaces(ctx, pods); err != nil {
		return nil, err
	}
	if err := b.linkHosts(ctx); err != nil {
		return nil, err
	}
	if err := b.linkPods(ctx); err != nil {
		return nil, err
	}
	return b, nil
}

// addNamespaces adds the node, client, external host and pods namespaces to the lab.
func (b *Bed) addNamespaces(ctx context.Context, pods int) error {
	var err error
	add := func(role string) *netns.NS {
		if err != nil {
			return nil
		}
		var ns *netns.NS
		ns, err = b.Lab.Add(ctx, role)
		return ns
	}
	b.Node, b.Client, b.External = add("node"), add("client"), add("ext")
	for i := 1; i <= pods; i++ {
		if ns := add(fmt.Sprintf("pod%d", i)); ns != nil {
			b.Pods = append(b.Pods, &Pod{NS: ns, Name: fmt.Sprintf("pod%d", i), IP: PodIP(i)})
		}
	}
	return err
}

// linkHosts links the client and the external host to the node, routes the service ranges to the
// node and makes the node forward.
func (b *Bed) linkHosts(ctx context.Context) error {
	steps := []func() error{
		func() error {
			return netns.Link(ctx, netns.End{NS: b.Node, Dev: "to-client", Addr: netip.PrefixFrom(NodeClientIP, 24)},
				netns.End{NS: b.Client, Dev: "eth0", Addr: netip.PrefixFrom(ClientIP, 24)})
		},
		func() error { return b.Client.AddRoute(ctx, netip.MustParsePrefix("0.0.0.0/0"), NodeClientIP, "eth0") },
		func() error {
			return netns.Link(ctx, netns.End{NS: b.Node, Dev: "to-ext", Addr: netip.PrefixFrom(NodeExtIP, 24)},
				netns.End{NS: b.External, Dev: "eth0", Addr: netip.PrefixFrom(ExternalIP, 24)})
		},
		func() error { return b.External.AddRoute(ctx, ClusterRange, NodeExtIP, "eth0") },
		func() error { return b.External.AddRoute(ctx, ExternalRange, NodeExtIP, "eth0") },
		// The node's own traffic to a service IP needs a route before OUTPUT's DNAT can apply (a
		// real node has a default route). The kernel here may lack the dummy device, so the route
		// points at the client link; unmatched packets would only draw unanswered ARP there.
		func() error { return b.Node.AddRoute(ctx, ClusterRange, netip.Addr{}, "to-client") },
		func() error { return b.Node.AddRoute(ctx, ExternalRange, netip.Addr{}, "to-client") },
		// A node forwards its pods' traffic: a cluster IP is no local address, so a refused service
		// port (no endpoints) is answered by the filter REJECT rule in FORWARD. The cluster range
		// goes back out of the link it came in on, so the node would send ICMP redirects, which
		// use up the per-host ICMP budget that the port-unreachable answers need; a real node
		// routes it elsewhere. Both sysctls are per namespace.
		func() error {
			_, err := b.Node.Exec(ctx, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0",
				"net.ipv4.conf.to-client.send_redirects=0")
			return err
		},
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	return nil
}

// linkPods links each pod to the node, its default route via the node.
func (b *Bed) linkPods(ctx context.Context) error {
	for i, p := range b.Pods {
		i := i + 1
		err := netns.Link(ctx, netns.End{NS: b.Node, Dev: fmt.Sprintf("to-pod%d", i), Addr: netip.PrefixFrom(nodePodIP(i), 24)},
			netns.End{NS: p.NS, Dev: "eth0", Addr: netip.PrefixFrom(p.IP, 24)})
		if err != nil {
			return err
		}
		if err := p.NS.AddRoute(ctx, netip.MustParsePrefix("0.0.0.0/0"), nodePodIP(i), "eth0"); err != nil {
			return err
		}
	}
	return nil
}

// Serve starts the pod's backends until ctx is done: on TCP port tcpPort each connection is
// greeted with "<pod name>\n" and then echoed; on UDP port udpPort each datagram is answered with
// "<pod name> <datagram>". The returned func waits for the servers to stop.
func (p *Pod) Serve(ctx context.Context, tcpPort, udpPort uint16) (wait func(), err error) {
	var ln net.Listener
	var pc net.PacketConn
	err = p.NS.Do(func() error {
		var err error
		if ln, err = net.Listen("tcp4", fmt.Sprintf(":%d", tcpPort)); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp4", fmt.Sprintf(":%d", udpPort))
		return err
	})
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		return nil, fmt.Errorf("pod %s: listen: %w", p.Name, err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { <-ctx.Done(); ln.Close(); pc.Close() })
	wg.Go(func() { serveTCP(ln, p.Name) })
	wg.Go(func() { serveUDP(pc, p.Name) })
	return wg.Wait, nil
}

func serveTCP(ln net.Listener, name string) {
	var wg sync.WaitGroup
	defer wg.Wait()
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	defer func() {
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		mu.Lock()
		conns[c] = true
		mu.Unlock()
		wg.Go(func() {
			defer func() { mu.Lock(); delete(conns, c); mu.Unlock(); c.Close() }()
			if _, err := fmt.Fprintf(c, "%s\n", name); err != nil {
				return
			}
			buf := make([]byte, 32*1024)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					if tc, ok := c.(*net.TCPConn); ok {
						_ = tc.CloseWrite()
					}
					return
				}
			}
		})
	}
}

func serveUDP(pc net.PacketConn, name string) {
	buf := make([]byte, 65536)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		reply := append([]byte(name+" "), buf[:n]...)
		_, _ = pc.WriteTo(reply, from)
	}
}

// Who connects from ns to addr over TCP and returns the greeting (the pod name).
func Who(ns *netns.NS, addr netip.AddrPort, timeout time.Duration) (string, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp", addr.String(), timeout)
		return err
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("read greeting from %s: %w", addr, err)
	}
	return strings.TrimSpace(line), nil
}

// Dial opens a TCP connection from ns (for tests that keep it open).
func Dial(ns *netns.NS, addr netip.AddrPort, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp", addr.String(), timeout)
		return err
	})
	return c, err
}

// WhoUDP sends one datagram from ns to addr and returns the pod name of the reply.
func WhoUDP(ns *netns.NS, addr netip.AddrPort, timeout time.Duration) (string, error) {
	var c net.Conn
	if err := ns.Do(func() error {
		var err error
		c, err = net.Dial("udp", addr.String())
		return err
	}); err != nil {
		return "", err
	}
	defer c.Close()
	return Ask(c, "who", timeout)
}

// Ask sends a datagram on a connected UDP socket and returns the pod name of the reply.
func Ask(c net.Conn, payload string, timeout time.Duration) (string, error) {
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte(payload)); err != nil {
		return "", err
	}
	buf := make([]byte, 65536)
	n, err := c.Read(buf)
	if err != nil {
		return "", err
	}
	name, rest, _ := strings.Cut(string(buf[:n]), " ")
	if rest != payload {
		return "", errors.New("reply does not echo the request")
	}
	return name, nil
}

// Eventually polls f until it returns nil or the deadline passes, returning the last error.
func Eventually(ctx context.Context, timeout, every time.Duration, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("after %v: %w", timeout, err)
		case <-time.After(every):
		}
	}
}

// ServePods starts every pod's backends (see Pod.Serve); stop ends them and waits.
func (b *Bed) ServePods(ctx context.Context, tcpPort, udpPort uint16) (stop func(), err error) {
	return servePods(ctx, b.Pods, tcpPort, udpPort)
}

func servePods(ctx context.Context, pods []*Pod, tcpPort, udpPort uint16) (stop func(), err error) {
	ctx, cancel := context.WithCancel(ctx)
	var waits []func()
	stop = func() {
		cancel()
		for _, w := range waits {
			w()
		}
	}
	for _, p := range pods {
		wait, err := p.Serve(ctx, tcpPort, udpPort)
		if err != nil {
			stop()
			return nil, err
		}
		waits = append(waits, wait)
	}
	return stop, nil
}

// Start builds a fresh lab with the bed and serves every pod's backends on tcpPort/udpPort.
// close stops the backends and deletes every namespace; call it also when Start fails half-way
// (it is never nil).
func Start(ctx context.Context, pods int, tcpPort, udpPort uint16) (bed *Bed, close func() error, err error) {
	lab, err := netns.NewLab()
	if err != nil {
		return nil, func() error { return nil }, err
	}
	stopPods := func() {}
	close = func() error {
		stopPods()
		return lab.Close()
	}
	if bed, err = New(ctx, lab, pods); err != nil {
		return nil, close, err
	}
	stop, err := bed.ServePods(ctx, tcpPort, udpPort)
	if err != nil {
		return nil, close, err
	}
	stopPods = stop
	return bed, close, nil
}

// SteerTransparentReplies installs, in the node namespace, what brings an endpoint's replies to a
// socket the node bound to a client's address (IP_TRANSPARENT), as the transparent source mode's
// plumbing does (portal/transparent, which the data-path tests do not depend on): a mangle mark
// on packets of a transparent socket, an ip rule for the mark and a local default route in its
// table.
func (b *Bed) SteerTransparentReplies(ctx context.Context) error {
	for _, args := range [][]string{
		{"iptables", "-w", "-t", "mangle", "-A", "PREROUTING", "-m", "socket", "--transparent", "-j", "MARK", "--set-xmark", "0x100000/0x100000"},
		{"ip", "rule", "add", "fwmark", "0x100000/0x100000", "lookup", "27504"},
		{"ip", "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "27504"},
	} {
		if out, err := b.Node.Exec(ctx, args...); err != nil {
			return fmt.Errorf("reply steering in %s: %v: %w: %s", b.Node.Name, args, err, out)
		}
	}
	return nil
}
