package udp

import (
	"context"
	"net"
	"net/netip"
	"os/exec"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestFlowEventsOfAFailedSession: an endpoint socket error other than port unreachable (here ICMP
// host prohibited: EHOSTUNREACH) ends the session as EndpointError, verdict failed.
//
// Address plan, two throwaway namespaces on one veth pair (netns.NewTestPair): the proxy and its
// client on the node namespace's loopback, the endpoint 10.100.0.2:53 in the other namespace,
// whose INPUT rule answers every datagram with ICMP host prohibited (a hard error: plain host
// unreachable is soft, and a connected UDP socket without IP_RECVERR is not told of it).
func TestFlowEventsOfAFailedSession(t *testing.T) {
	if _, err := exec.LookPath("iptables"); err != nil {
		testenv.Unavailable(t, "iptables not found: %v", err)
	}
	peer, ns := netns.NewTestPair(t)
	peer.MustExec(t, "iptables", "-A", "INPUT", "-p", "udp", "--dport", "53", "-j", "REJECT", "--reject-with", "icmp-host-prohibited")

	endpoint := netip.MustParseAddrPort("10.100.0.2:53")
	log := &flowLog{}
	type sockets struct {
		p *Proxy
		c *net.UDPConn
	}
	ready := make(chan sockets, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- ns.Do(func() error {
			var s sockets
			s.p = New(testService, newFakePicker(endpoint), Config{Flows: log})
			if err := s.p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
				close(ready)
				return err
			}
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(s.p.Addr()))
			if err != nil {
				close(ready)
				return err
			}
			s.c = c
			ready <- s
			return s.p.Run(ctx)
		})
	}()
	s, ok := <-ready
	if !ok {
		t.Fatalf("set up in the namespace: %v", <-done)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		s.c.Close()
	}()
	if _, err := s.c.Write([]byte("query")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			log.mu.Lock()
			t.Logf("stats %+v events %+v", s.p.Stats(), log.evs)
			log.mu.Unlock()
			out, _ := peer.Exec(context.Background(), "iptables", "-vnL", "INPUT")
			t.Logf("%s", out)
		}
	})
	evs := log.until(t, "the session to end", ends(1))
	var end flow.Event
	for _, e := range evs {
		if e.Phase == flow.PhaseEnd {
			end = e
		}
	}
	end.Port = &flow.Port{Protocol: flow.UDP}
	if end.End != flow.EndpointError || end.Verdict() != flow.Failed || end.Endpoint != endpoint || end.Client != s.c.LocalAddr().(*net.UDPAddr).AddrPort() {
		t.Errorf("end: reason %v, verdict %v, endpoint %s, client %s; want endpoint-error, failed, %s, %s",
			end.End, end.Verdict(), end.Endpoint, end.Client, endpoint, s.c.LocalAddr())
	}
	if len(evs) != 2 || evs[0].Phase != flow.PhaseStart {
		t.Errorf("events %+v, want the session's start and end", evs)
	}
}
