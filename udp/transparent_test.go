package udp

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// alwaysTransparent is a flow.SourcePolicy that says transparent for every session.
type alwaysTransparent struct{}

func (alwaysTransparent) Transparent(client, endpoint netip.Addr) bool { return true }

// TestTransparentSource: with Config.Source saying transparent, a session's socket sends from
// the client's address and port, which the endpoint sees, and its replies come back to the
// client; with Source nil the endpoint sees the node; a client port the proxy cannot take falls
// back to the node's address and is counted.
//
// Address plan (internal/testbed, one pod; routed, no bridge):
//
//	client 172.30.0.2 --- 172.30.0.1 node 10.244.1.1 --- 10.244.1.10 pod (the endpoint)
//
// The client and the pod route everything via the node. In the node namespace, the reply
// steering of the transparent design: a mangle PREROUTING rule marks packets of transparent
// sockets, a rule sends marked packets to table 27504, whose one route delivers them locally.
// The proxy runs inside the node namespace (Run in NS.Do: every loop opens its sockets there).
func TestTransparentSource(t *testing.T) {
	bed := transparentLab(t)
	nodePodSide := netip.MustParseAddr("10.244.1.1") // the node's address on the pod's link

	// The endpoint answers each datagram with the address it came from.
	var echo *net.UDPConn
	if err := bed.Pods[0].NS.Do(func() (err error) {
		echo, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(testbed.PodIP(1), 0)))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	echoDone := make(chan struct{})
	go func() {
		defer close(echoDone)
		buf := make([]byte, 512)
		for {
			_, from, err := echo.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			echo.WriteToUDPAddrPort([]byte(from.String()), from)
		}
	}()
	defer func() { echo.Close(); <-echoDone }()
	ep := echo.LocalAddr().(*net.UDPAddr).AddrPort()

	// ask sends a datagram from the client namespace, from port (0: any), and returns the
	// client's address and what the endpoint saw.
	ask := func(t *testing.T, p *Proxy, port uint16) (from, seen netip.AddrPort) {
		t.Helper()
		var c *net.UDPConn
		if err := bed.Client.Do(func() (err error) {
			c, err = net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(testbed.ClientIP, port)))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.WriteToUDPAddrPort([]byte("q"), p.Addr()); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 512)
		n, replyFrom, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			t.Fatalf("no reply through the proxy: %v (stats %+v)", err, p.Stats())
		}
		if replyFrom != p.Addr() {
			t.Errorf("reply from %s, want the proxy's %s", replyFrom, p.Addr())
		}
		seen, err = netip.ParseAddrPort(string(buf[:n]))
		if err != nil {
			t.Fatalf("the endpoint said %q: %v", buf[:n], err)
		}
		return c.LocalAddr().(*net.UDPAddr).AddrPort(), seen
	}
	start := func(t *testing.T, cfg Config) (*Proxy, *startRecorder) {
		t.Helper()
		rec := &startRecorder{}
		cfg.Flows, cfg.Logger = rec, quietLogger()
		p := New(testService, newFakePicker(ep), cfg)
		ctx, cancel := context.WithCancel(context.Background())
		ready, done := make(chan error, 1), make(chan error, 1)
		go func() {
			done <- bed.Node.Do(func() error {
				err := p.Listen(netip.AddrPortFrom(testbed.NodeClientIP, 0))
				ready <- err
				if err != nil {
					return err
				}
				return p.Run(ctx)
			})
		}()
		if err := <-ready; err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
		return p, rec
	}

	t.Run("transparent_the_endpoint_sees_the_client", func(t *testing.T) {
		p, rec := start(t, Config{Source: alwaysTransparent{}})
		from, seen := ask(t, p, 0)
		if seen != from {
			t.Errorf("the endpoint saw %s, want the client's %s", seen, from)
		}
		if src := rec.source(); src != from {
			t.Errorf("the Start event's Source %s, want %s", src, from)
		}
		if got, want := transparentCounts(p.Stats()), [2]uint64{1, 0}; got != want {
			t.Errorf("transparent dials, fallbacks %v, want %+v", got, want)
		}
	})
	t.Run("nil_source_the_endpoint_sees_the_node", func(t *testing.T) {
		p, _ := start(t, Config{})
		_, seen := ask(t, p, 0)
		if seen.Addr() != nodePodSide {
			t.Errorf("the endpoint saw %s, want the node's address %s", seen, nodePodSide)
		}
		if got := transparentCounts(p.Stats()); got != [2]uint64{} {
			t.Errorf("transparent dials, fallbacks %v, want none", got)
		}
	})
	t.Run("client_port_taken_falls_back_to_the_node", func(t *testing.T) {
		// A transparent socket of the node's, without SO_REUSEADDR, holds the client's address
		// and port: the proxy's bind gets EADDRINUSE.
		var fd int
		var taken netip.AddrPort
		if err := bed.Node.Do(func() (err error) {
			fd, taken, err = bindTransparentNoReuse(netip.AddrPortFrom(testbed.ClientIP, 0))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		p, _ := start(t, Config{Source: alwaysTransparent{}})
		from, seen := ask(t, p, taken.Port())
		if from != taken {
			t.Fatalf("the client sent from %s, want %s", from, taken)
		}
		if seen.Addr() != nodePodSide {
			t.Errorf("the endpoint saw %s, want the node's address %s", seen, nodePodSide)
		}
		if got, want := transparentCounts(p.Stats()), [2]uint64{0, 1}; got != want {
			t.Errorf("transparent dials, fallbacks %v, want %+v", got, want)
		}
	})
}

// transparentLab builds the namespaces of TestTransparentSource and the node's reply steering.
func transparentLab(t *testing.T) *testbed.Bed {
	t.Helper()
	for _, tool := range []string{"iptables", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Unavailable(t, "%s not installed", tool)
		}
	}
	bed, err := testbed.New(t.Context(), netns.NewTestLab(t), 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := bed.SteerTransparentReplies(t.Context()); err != nil {
		testenv.Unavailable(t, "%v", err)
	}
	return bed
}

// bindTransparentNoReuse binds a UDP socket with IP_TRANSPARENT and no SO_REUSEADDR to ap.
func bindTransparentNoReuse(ap netip.AddrPort) (int, netip.AddrPort, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, netip.AddrPort{}, err
	}
	err = errors.Join(unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1), unix.Bind(fd, sockopt.ToSockaddr(ap)))
	var sa unix.Sockaddr
	if err == nil {
		sa, err = unix.Getsockname(fd)
	}
	if err != nil {
		unix.Close(fd)
		return -1, netip.AddrPort{}, err
	}
	return fd, sockopt.FromSockaddr(sa), nil
}

// startRecorder keeps the Source of the Start events (recorded on the proxy loop before the
// datagram goes on, so before the reply the test waits for).
type startRecorder struct {
	mu  sync.Mutex
	src netip.AddrPort
}

func (r *startRecorder) Record(e *flow.Event) {
	if e.Phase == flow.PhaseStart {
		r.mu.Lock()
		r.src = e.Source
		r.mu.Unlock()
	}
}

func (r *startRecorder) source() netip.AddrPort {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.src
}

// transparentCounts is a socket's transparent dials and fallbacks.
func transparentCounts(st flow.Stats) [2]uint64 {
	return [2]uint64{st.TransparentDials, st.TransparentFallbacks}
}
