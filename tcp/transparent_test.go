package tcp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/sockopt"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// transparentLabEnv names the namespaces of a transparent lab ("node client pod") to the child
// process TestTransparentSource runs in the node namespace.
const transparentLabEnv = "KPP_TCP_TRANSPARENT_LAB"

// alwaysTransparent is a flow.SourcePolicy that says transparent for every dial.
type alwaysTransparent struct{}

func (alwaysTransparent) Transparent(client, endpoint netip.Addr) bool { return true }

// TestTransparentSource: with Config.Source saying transparent, the endpoint sees the client's
// address and port; with Source nil, the node's; a client port the proxy cannot take falls back
// to the node's address and is counted. On both engines (TestEveryTestOnIOUring reruns it).
//
// Address plan (internal/testbed, one pod; routed, no bridge):
//
//	client 172.30.0.2 --- 172.30.0.1 node 10.244.1.1 --- 10.244.1.10 pod (the endpoint)
//
// The client and the pod route everything via the node. In the node namespace, the reply
// steering of the transparent design: a mangle PREROUTING rule marks packets of transparent
// sockets, a rule sends marked packets to table 27504, whose one route delivers them locally.
//
// A proxy's dials happen on threads of their own (the epoll engine's goroutines, the io_uring
// engine's loop), and a socket belongs to the namespace of the thread that opens it, so the
// proxy runs in a child process started in the node namespace (TestTransparentSourceInNode):
// all its threads are there. This test builds the lab and runs that child.
func TestTransparentSource(t *testing.T) {
	if os.Getenv(transparentLabEnv) != "" {
		t.Skip("the child run itself")
	}
	bed := transparentLab(t)
	args := []string{"ip", "netns", "exec", bed.Node.Name, os.Args[0], "-test.run=^TestTransparentSourceInNode$", "-test.v"}
	cmd := exec.CommandContext(t.Context(), args[0], args[1:]...)
	cmd.Env = append(os.Environ(), transparentLabEnv+"="+strings.Join([]string{bed.Node.Name, bed.Client.Name, bed.Pods[0].NS.Name}, " "))
	out, err := cmd.CombinedOutput()
	if err != nil || testing.Verbose() {
		t.Logf("the proxy in the node namespace:\n%s", out)
	}
	if err != nil {
		t.Fatalf("the proxy in the node namespace: %v", err)
	}
	if !strings.Contains(string(out), "--- PASS: TestTransparentSourceInNode") {
		t.Fatal("the child did not run TestTransparentSourceInNode")
	}
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

// TestTransparentSourceInNode is TestTransparentSource's child, in the node namespace.
func TestTransparentSourceInNode(t *testing.T) {
	names := strings.Fields(os.Getenv(transparentLabEnv))
	if len(names) != 3 {
		t.Skip("runs only as TestTransparentSource's child")
	}
	client, pod := &netns.NS{Name: names[1]}, &netns.NS{Name: names[2]}
	proxyAddr := netip.AddrPortFrom(testbed.NodeClientIP, 0)
	nodePodSide := netip.MustParseAddr("10.244.1.1") // the node's address on the pod's link

	// The endpoint writes back the address it saw the connection come from, then reads what
	// comes (a PROXY header) until the client closes: closing with unread bytes would reset.
	var ln net.Listener
	if err := pod.Do(func() (err error) {
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(testbed.PodIP(1), 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.ServeTCP(t, ln, func(c net.Conn) {
		fmt.Fprintln(c, c.RemoteAddr())
		c.(*net.TCPConn).CloseWrite()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		io.Copy(io.Discard, c)
	})
	ep := ln.Addr().(*net.TCPAddr).AddrPort()

	// ask connects from the client namespace, from port (0: any), and returns the client's
	// address and what the endpoint saw.
	ask := func(t *testing.T, p *Proxy, port uint16) (from, seen netip.AddrPort) {
		t.Helper()
		var c net.Conn
		if err := client.Do(func() (err error) {
			d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(testbed.ClientIP, port))}
			c, err = d.Dial("tcp4", p.Addr().String())
			return err
		}); err != nil {
			t.Fatalf("dial the proxy %s from the client namespace: %v (stats %+v)", p.Addr(), err, p.Stats())
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			t.Fatalf("read what the endpoint saw: %v", err)
		}
		seen, err = netip.ParseAddrPort(strings.TrimSpace(line))
		if err != nil {
			t.Fatalf("the endpoint said %q: %v", line, err)
		}
		return c.LocalAddr().(*net.TCPAddr).AddrPort(), seen
	}
	start := func(t *testing.T, cfg Config) (*Proxy, *dialRecorder, closedCh) {
		rec, ended := &dialRecorder{}, make(closedCh, 1)
		cfg.Flows, cfg.OnEnd, cfg.Logger = rec, ended.onClose, testLogger(t)
		p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, cfg)
		if err := p.Listen(proxyAddr); err != nil {
			t.Fatal(err)
		}
		go p.Run(t.Context())
		t.Cleanup(p.Shutdown)
		return p, rec, ended
	}

	t.Run("transparent_the_endpoint_sees_the_client", func(t *testing.T) {
		p, rec, ended := start(t, Config{Source: alwaysTransparent{}})
		from, seen := ask(t, p, 0)
		if seen != from {
			t.Errorf("the endpoint saw %s, want the client's %s", seen, from)
		}
		// The flow's Source (what a capture draws the pod leg from) is the client's address
		// too, and the access log names the client and the endpoint as always.
		if src := rec.source(); src != from {
			t.Errorf("the Dial event's Source %s, want %s", src, from)
		}
		if info := ended.next(t); info.Client != from || info.Endpoint != ep {
			t.Errorf("OnEnd client %s endpoint %s, want %s, %s", info.Client, info.Endpoint, from, ep)
		}
		if got, want := transparentCounts(p.Stats()), [2]uint64{1, 0}; got != want {
			t.Errorf("transparent dials, fallbacks %v, want %+v", got, want)
		}
	})
	t.Run("nil_source_the_endpoint_sees_the_node", func(t *testing.T) {
		p, rec, _ := start(t, Config{})
		_, seen := ask(t, p, 0)
		if seen.Addr() != nodePodSide {
			t.Errorf("the endpoint saw %s, want the node's address 10.244.1.1", seen)
		}
		if src := rec.source(); src != seen {
			t.Errorf("the Dial event's Source %s, want %s", src, seen)
		}
		if got := transparentCounts(p.Stats()); got != [2]uint64{} {
			t.Errorf("transparent dials, fallbacks %v, want none", got)
		}
	})
	t.Run("client_port_taken_falls_back_to_the_node", func(t *testing.T) {
		// A transparent socket of the node's, without SO_REUSEADDR, holds the client's address
		// and port: the proxy's bind gets EADDRINUSE.
		fd, taken := bindTransparentNoReuse(t, netip.AddrPortFrom(testbed.ClientIP, 0))
		defer unix.Close(fd)
		p, _, _ := start(t, Config{Source: alwaysTransparent{}})
		from, seen := ask(t, p, taken.Port())
		if from != taken {
			t.Fatalf("the client dialed from %s, want %s", from, taken)
		}
		if seen.Addr() != nodePodSide {
			t.Errorf("the endpoint saw %s, want the node's address 10.244.1.1", seen)
		}
		if got, want := transparentCounts(p.Stats()), [2]uint64{0, 1}; got != want {
			t.Errorf("transparent dials, fallbacks %v, want %+v", got, want)
		}
	})
	t.Run("proxy_protocol_wins", func(t *testing.T) {
		// The endpoint expects the header and the connection from a proxy it trusts: the
		// connection comes from the node (the endpoint here ignores the header it gets).
		p, _, _ := start(t, Config{Source: alwaysTransparent{}, ProxyProtocol: proxyprotocol.V1})
		_, seen := ask(t, p, 0)
		if seen.Addr() != nodePodSide {
			t.Errorf("the endpoint saw %s, want the node's address %s", seen, nodePodSide)
		}
		if got := transparentCounts(p.Stats()); got != [2]uint64{} {
			t.Errorf("transparent dials, fallbacks %v, want none", got)
		}
	})
}

// bindTransparentNoReuse binds a TCP socket with IP_TRANSPARENT and no SO_REUSEADDR to ap.
func bindTransparentNoReuse(t *testing.T, ap netip.AddrPort) (int, netip.AddrPort) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	err = errors.Join(unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1), unix.Bind(fd, sockopt.ToSockaddr(ap)))
	var sa unix.Sockaddr
	if err == nil {
		sa, err = unix.Getsockname(fd)
	}
	if err != nil {
		unix.Close(fd)
		t.Fatalf("bind a transparent socket to %s: %v", ap, err)
	}
	return fd, sockopt.FromSockaddr(sa)
}

// dialRecorder keeps the Source of the Dial events; it is always observed.
type dialRecorder struct {
	mu  sync.Mutex
	src netip.AddrPort
}

func (r *dialRecorder) Record(e *flow.Event) {
	if e.Phase == flow.PhaseDial {
		r.mu.Lock()
		r.src = e.Source
		r.mu.Unlock()
	}
}

func (r *dialRecorder) Observed() bool { return true }

func (r *dialRecorder) source() netip.AddrPort {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.src
}

// transparentCounts is a socket's transparent dials and fallbacks.
func transparentCounts(st flow.Stats) [2]uint64 {
	return [2]uint64{st.TransparentDials, st.TransparentFallbacks}
}
