package conntrack

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	ct "github.com/ti-mo/conntrack"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Address plan of the kernel tests, all inside namespaces they create: client 10.100.0.2 and
// node 10.100.0.1 on one veth pair, node 10.244.1.1 and pod 10.244.1.10 on another. The client
// routes 10.96.0.0/16 via the node. The node's nat chains DNAT, as the kernel path's
// KUBE-SVC/KUBE-SEP chains do, the service 10.96.0.10:80/TCP to the pod's :8080 and
// 10.96.0.10:53/UDP to its :5353, 10.96.0.10:81/TCP to its :8081 (where nothing listens), and
// 10.96.0.11:80/TCP (no kernel-path port of the watcher's) to :8080 too.

var (
	kSvcTCP   = netip.MustParseAddrPort("10.96.0.10:80")
	kSvcUDP   = netip.MustParseAddrPort("10.96.0.10:53")
	kShutTCP  = netip.MustParseAddrPort("10.96.0.10:81")
	kOtherTCP = netip.MustParseAddrPort("10.96.0.11:80")
	kEpTCP    = netip.MustParseAddrPort("10.244.1.10:8080")
	kEpShut   = netip.MustParseAddrPort("10.244.1.10:8081")
	kEpUDP    = netip.MustParseAddrPort("10.244.1.10:5353")
)

type dnatLab struct{ client, node, pod *netns.NS }

func newDNATLab(t *testing.T) *dnatLab {
	l := &dnatLab{}
	l.client, l.node = netns.NewTestPair(t)
	lab := netns.NewTestLab(t)
	l.pod = lab.MustAdd(t, "pod")
	ctx := t.Context()
	if err := netns.Link(ctx, netns.End{NS: l.node, Dev: "p0", Addr: netip.MustParsePrefix("10.244.1.1/24")},
		netns.End{NS: l.pod, Dev: "eth0", Addr: netip.MustParsePrefix("10.244.1.10/24")}); err != nil {
		t.Fatal(err)
	}
	if err := l.client.AddRoute(ctx, netip.MustParsePrefix("10.96.0.0/16"), netip.MustParseAddr("10.100.0.1"), ""); err != nil {
		t.Fatal(err)
	}
	if err := l.pod.AddRoute(ctx, netip.MustParsePrefix("0.0.0.0/0"), netip.MustParseAddr("10.244.1.1"), ""); err != nil {
		t.Fatal(err)
	}
	sep := func(chain string, proto string, ep netip.AddrPort) []string {
		return []string{"iptables", "-t", "nat", "-A", chain, "-p", proto, "-j", "DNAT", "--to-destination", ep.String()}
	}
	svc := func(dst netip.AddrPort, proto, chain string) []string {
		return []string{"iptables", "-t", "nat", "-A", "KUBE-SERVICES", "-d", dst.Addr().String() + "/32", "-p", proto,
			"--dport", fmt.Sprint(dst.Port()), "-j", chain}
	}
	for _, cmd := range [][]string{
		{"sysctl", "-qw", "net.ipv4.ip_forward=1"},
		{"iptables", "-t", "nat", "-N", "KUBE-SERVICES"},
		{"iptables", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"},
		{"iptables", "-t", "nat", "-N", "KUBE-SVC-TCP"}, {"iptables", "-t", "nat", "-N", "KUBE-SEP-TCP"},
		{"iptables", "-t", "nat", "-N", "KUBE-SVC-UDP"}, {"iptables", "-t", "nat", "-N", "KUBE-SEP-UDP"},
		{"iptables", "-t", "nat", "-N", "KUBE-SVC-SHUT"}, {"iptables", "-t", "nat", "-N", "KUBE-SEP-SHUT"},
		{"iptables", "-t", "nat", "-A", "KUBE-SVC-SHUT", "-j", "KUBE-SEP-SHUT"},
		sep("KUBE-SEP-SHUT", "tcp", kEpShut), svc(kShutTCP, "tcp", "KUBE-SVC-SHUT"),
		{"iptables", "-t", "nat", "-A", "KUBE-SVC-TCP", "-j", "KUBE-SEP-TCP"},
		{"iptables", "-t", "nat", "-A", "KUBE-SVC-UDP", "-j", "KUBE-SEP-UDP"},
		sep("KUBE-SEP-TCP", "tcp", kEpTCP), sep("KUBE-SEP-UDP", "udp", kEpUDP),
		svc(kSvcTCP, "tcp", "KUBE-SVC-TCP"), svc(kOtherTCP, "tcp", "KUBE-SVC-TCP"), svc(kSvcUDP, "udp", "KUBE-SVC-UDP"),
		// Counters and start/stop times are off by default; the node's entries die fast so
		// their DESTROY comes within the test (sysctls under net. are per namespace).
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_timestamp=1"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_close=1"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_udp_timeout=1"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_udp_timeout_stream=1"},
	} {
		l.node.MustExec(t, cmd...)
	}
	var ln net.Listener
	var pc net.PacketConn
	if err := l.pod.Do(func() (err error) {
		if ln, err = net.Listen("tcp", kEpTCP.String()); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", kEpUDP.String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The pod echoes each connection until the client closes it, then closes: the client
	// closes first.
	testenv.ServeTCP(t, ln, func(c net.Conn) { io.Copy(c, c) })
	testenv.EchoPackets(t, pc)
	return l
}

// tcpExchange connects from the client to dst, sends msg, reads it back and closes, with a reset
// if reset is set.
func (l *dnatLab) tcpExchange(t *testing.T, dst netip.AddrPort, msg string, reset bool) (client netip.AddrPort) {
	t.Helper()
	err := l.client.Do(func() error {
		c, err := net.DialTimeout("tcp", dst.String(), 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		client = c.LocalAddr().(*net.TCPAddr).AddrPort()
		if reset {
			if err := c.(*net.TCPConn).SetLinger(0); err != nil {
				return err
			}
		}
		if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
			return err
		}
		if _, err := c.Write([]byte(msg)); err != nil {
			return err
		}
		_, err = io.ReadFull(c, make([]byte, len(msg)))
		return err
	})
	if err != nil {
		t.Fatalf("TCP exchange with %s: %v", dst, err)
	}
	return client
}

// tcpRefused connects from the client to dst and expects a refusal.
func (l *dnatLab) tcpRefused(t *testing.T, dst netip.AddrPort) {
	t.Helper()
	err := l.client.Do(func() error {
		c, err := net.DialTimeout("tcp", dst.String(), 5*time.Second)
		if err == nil {
			c.Close()
			return fmt.Errorf("connected")
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatalf("TCP connection to %s: %v; want it refused", dst, err)
	}
}

// udpExchange sends one datagram from the client to dst and reads the answer.
func (l *dnatLab) udpExchange(t *testing.T, dst netip.AddrPort, msg string) (client netip.AddrPort) {
	t.Helper()
	err := l.client.Do(func() error {
		c, err := net.Dial("udp", dst.String())
		if err != nil {
			return err
		}
		defer c.Close()
		client = c.LocalAddr().(*net.UDPAddr).AddrPort()
		if err := c.SetDeadline(time.Now().Add(5 * time.Second)); err != nil {
			return err
		}
		if _, err := c.Write([]byte(msg)); err != nil {
			return err
		}
		_, err = c.Read(make([]byte, 64))
		return err
	})
	if err != nil {
		t.Fatalf("UDP exchange with %s: %v", dst, err)
	}
	return client
}

// reapExpired dumps the node's conntrack table: a dump deletes the entries it finds expired, so
// their DESTROY comes now rather than when the kernel's garbage collector next passes (up to a
// minute on a quiet table).
func (l *dnatLab) reapExpired(t *testing.T) {
	t.Helper()
	err := l.node.Do(func() error {
		c, err := ct.Dial(nil)
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Dump(nil)
		return err
	})
	if err != nil {
		t.Fatalf("dump the node's conntrack table: %v", err)
	}
}

// startWatcher runs w in the node's namespace until the test ends and waits until it listens.
func startWatcher(t *testing.T, w *Watcher) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(testenv.WaitTimeout):
			t.Error("Run did not return after its context ended")
		}
	})
	select {
	case <-w.Ready():
	case err := <-done:
		t.Fatalf("Run ended before it listened: %v", err)
	case <-time.After(testenv.WaitTimeout):
		t.Fatal("the watcher did not listen in time")
	}
}

// TestWatcherReportsKernelPathFlows makes TCP connections (closed, reset, refused) and a UDP
// exchange through the node's DNAT rules, and a TCP connection to an address of no kernel-path
// port, and checks that each of the first four reaches its port's Recorder as a Start then an
// End with the client, the service address, the DNAT target, the kernel's counters and an end
// reason, and that nothing of the last does.
func TestWatcherReportsKernelPathFlows(t *testing.T) {
	l := newDNATLab(t)
	tcpRec, udpRec, shutRec := &events{}, &events{}, &events{}
	var log testenv.SyncBuffer
	logger := logrus.New()
	logger.SetOutput(&log)
	w := NewWatcher(ports{{flow.TCP, kSvcTCP}: tcpRec, {flow.UDP, kSvcUDP}: udpRec, {flow.TCP, kShutTCP}: shutRec},
		Options{Do: l.node.Do, Logger: logger})
	startWatcher(t, w)

	l.tcpExchange(t, kOtherTCP, "not ours", false)
	const msgTCP, msgUDP = "hello kernel path", "dns?"
	closed := l.tcpExchange(t, kSvcTCP, msgTCP, false)
	reset := l.tcpExchange(t, kSvcTCP, msgTCP, true)
	udpClient := l.udpExchange(t, kSvcUDP, msgUDP)
	l.tcpRefused(t, kShutTCP)

	// Each flow's NEW and DESTROY, the other connection's included: once those ten are read,
	// anything reported for it would have been.
	testenv.WaitForEvery(t, 20*time.Second, 100*time.Millisecond, "the End of every flow and ten conntrack events", func() bool {
		l.reapExpired(t)
		return len(tcpRec.get()) >= 4 && len(udpRec.get()) >= 2 && len(shutRec.get()) >= 2 && w.Stats().Events >= 10
	})

	byClient := func(rec *events, client netip.AddrPort) []flow.Event {
		return slices.DeleteFunc(rec.get(), func(e flow.Event) bool { return e.Client != client })
	}
	shut := shutRec.get()
	for _, c := range []struct {
		name              string
		evs               []flow.Event
		client, local, ep netip.AddrPort
		minBytes, packets uint64
		end               flow.EndReason
		err               error
	}{
		// TCP: conntrack counts IP bytes, headers and handshake included. Who closed first
		// is not in DESTROY: Unknown, no error.
		{"tcp closed", byClient(tcpRec, closed), closed, kSvcTCP, kEpTCP, uint64(len(msgTCP)) + 3*40, 0, flow.Unknown, nil},
		{"tcp reset", byClient(tcpRec, reset), reset, kSvcTCP, kEpTCP, uint64(len(msgTCP)) + 3*40, 0, flow.Unknown, ErrReset},
		// The endpoint refused: a SYN one way, a RST back.
		{"tcp refused", shut, shut[0].Client, kShutTCP, kEpShut, 40, 0, flow.DialFailed, nil},
		// UDP: one datagram each way, 28 bytes of IPv4 and UDP headers each.
		{"udp", udpRec.get(), udpClient, kSvcUDP, kEpUDP, uint64(len(msgUDP)) + 28, 1, flow.IdleTimeout, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			var phases []string
			for _, e := range c.evs {
				phases = append(phases, e.Phase.String())
			}
			if d := cmp.Diff([]string{"start", "end"}, phases); d != "" {
				t.Fatalf("phases (-want +got):\n%s\nevents: %+v", d, c.evs)
			}
			start, end := c.evs[0], c.evs[1]
			for _, e := range c.evs {
				got := []string{e.Client.String(), e.Local.String(), e.Endpoint.String()}
				want := []string{c.client.String(), c.local.String(), c.ep.String()}
				if d := cmp.Diff(want, got); d != "" {
					t.Errorf("%s: client, local, endpoint (-want +got):\n%s", e.Phase, d)
				}
			}
			if start.ID != end.ID || start.ID&IDBit == 0 {
				t.Errorf("IDs %#x and %#x: want one kernel-path ID", start.ID, end.ID)
			}
			if start.Start.IsZero() || !end.Start.Equal(start.Start) || end.Duration <= 0 || end.Time.Before(end.Start) {
				t.Errorf("times: start %v; end at %v, started %v, lasted %v: want the same start and a positive duration",
					start.Start, end.Time, end.Start, end.Duration)
			}
			if end.BytesToEndpoint < c.minBytes || end.BytesToClient < c.minBytes ||
				end.PacketsToEndpoint != c.packets || end.PacketsToClient != c.packets {
				t.Errorf("counters: %d B (%d packets) to the endpoint, %d B (%d) to the client: want at least %d B each, %d packets",
					end.BytesToEndpoint, end.PacketsToEndpoint, end.BytesToClient, end.PacketsToClient, c.minBytes, c.packets)
			}
			if end.End != c.end || end.Err != c.err {
				t.Errorf("end reason %v (%v), want %v (%v)", end.End, end.Err, c.end, c.err)
			}
		})
	}
	if st := w.Stats(); st.Started != 4 || st.Ended != 4 || st.Overruns != 0 || st.Undecodable != 0 {
		t.Errorf("stats %+v: want 4 started, 4 ended, no overrun, nothing undecodable", st)
	}
	if strings.Contains(log.String(), "nf_conntrack") {
		t.Errorf("warned of sysctls that are on:\n%s", log.String())
	}
}

// TestWatcherStopsWithItsContext: Run returns nil soon after its context ends, having closed
// its socket and left no goroutine; with counters and timestamps off (the kernel's defaults)
// it said so once when it started.
func TestWatcherStopsWithItsContext(t *testing.T) {
	_, node := netns.NewTestPair(t)
	// Load conntrack in the namespace, as the kernel path's rules do, so its sysctls exist.
	node.MustExec(t, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", "10.96.0.10/32", "-j", "ACCEPT")
	before := runtime.NumGoroutine()
	var log testenv.SyncBuffer
	logger := logrus.New()
	logger.SetOutput(&log)
	w := NewWatcher(ports{}, Options{Do: node.Do, Logger: logger})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	select {
	case <-w.Ready():
	case err := <-done:
		t.Fatalf("Run ended before it listened: %v", err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after cancel: %v, want nil", err)
		}
	case <-time.After(testenv.WaitTimeout):
		t.Fatal("Run did not return after its context ended")
	}
	testenv.WaitFor(t, fmt.Sprintf("the goroutines to be back to %d", before), func() bool {
		return runtime.NumGoroutine() <= before
	})
	lines := slices.DeleteFunc(log.Lines(), func(s string) bool { return !strings.Contains(s, "nf_conntrack") })
	if len(lines) != 1 || !strings.Contains(lines[0], "net.netfilter.nf_conntrack_acct,net.netfilter.nf_conntrack_timestamp") {
		t.Errorf("log lines about the sysctls: %q; want one naming both", lines)
	}
}

// blocking is a Recorder whose first Record waits until release is closed, as a reader that
// falls behind would.
type blocking struct {
	events
	once    sync.Once
	release chan struct{}
}

func (b *blocking) Record(e *flow.Event) {
	b.once.Do(func() { <-b.release })
	b.events.Record(e)
}

// TestWatcherKeepsGoingAfterAnOverrun: while the watcher is stuck, a burst of flows overflows
// its (smallest) socket buffer; the overrun is counted and logged once, and flows after it are
// still reported.
func TestWatcherKeepsGoingAfterAnOverrun(t *testing.T) {
	l := newDNATLab(t)
	rec := &blocking{release: make(chan struct{})}
	var log testenv.SyncBuffer
	logger := logrus.New()
	logger.SetOutput(&log)
	w := NewWatcher(ports{{flow.UDP, kSvcUDP}: rec}, Options{Do: l.node.Do, Logger: logger, ReadBuffer: 1})
	startWatcher(t, w)

	for range 100 { // each from a new client port: a NEW each, far more than the buffer holds
		l.udpExchange(t, kSvcUDP, "burst")
	}
	close(rec.release)
	testenv.WaitFor(t, "an overrun to be counted", func() bool { return w.Stats().Overruns > 0 })
	after := l.udpExchange(t, kSvcUDP, "after")
	testenv.WaitFor(t, "the flow after the burst to be reported", func() bool {
		return slices.ContainsFunc(rec.get(), func(e flow.Event) bool { return e.Client == after })
	})
	lines := slices.DeleteFunc(log.Lines(), func(s string) bool { return !strings.Contains(s, "overflowed") })
	if len(lines) != 1 {
		t.Errorf("overrun log lines: %q; want one for the burst", lines)
	}
}

// TestWatcherEndComesWhenTheEntryExpires: a closed kernel-path connection's End reaches the
// stream within a few seconds of its entry's expiry (the lab's TIME_WAIT is 1 s), by the
// watcher's probe, not when the kernel's garbage collector next passes (up to a minute apart on
// a quiet table: without the probes this waited 15-62 s). Nothing else here dumps or looks the
// table up.
func TestWatcherEndComesWhenTheEntryExpires(t *testing.T) {
	l := newDNATLab(t)
	rec := &events{}
	w := NewWatcher(ports{{flow.TCP, kSvcTCP}: rec}, Options{Do: l.node.Do, ProbeInterval: 2 * time.Second})
	startWatcher(t, w)
	closed := l.tcpExchange(t, kSvcTCP, "bye", false)
	at := time.Now()
	testenv.WaitForEvery(t, 5*time.Second, 50*time.Millisecond, "the closed connection's End", func() bool {
		evs := rec.get()
		return len(evs) == 2 && evs[1].Phase == flow.PhaseEnd && evs[1].Client == closed
	})
	t.Logf("End %v after the close; %d probes", time.Since(at).Round(time.Millisecond), w.Stats().Probes)
}
