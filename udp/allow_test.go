package udp

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestAllowDropsDeniedClients: a datagram from a client the allow-check refuses opens no session
// and reaches no endpoint (the picker is never asked); it is counted in SourceDenied and reported
// as source-denied. An allowed client is proxied as usual.
// Address plan: denied client 127.0.0.10, allowed client 127.0.0.11, endpoint 127.0.0.2.
func TestAllowDropsDeniedClients(t *testing.T) {
	picker := newFakePicker(echoServer(t, "127.0.0.2", "a:"))
	denied := netip.MustParseAddr("127.0.0.10")
	ended := make(chan flow.Info, 8)
	p := startProxy(t, picker, Config{
		Allow: func(client netip.Addr) bool { return client != denied },
		OnEnd: func(f flow.Info) { ended <- f },
	})

	bad := newClient(t, "127.0.0.10", p.Addr())
	bad.send([]byte("hello"))
	select {
	case f := <-ended:
		if f.End != flow.SourceDenied || f.Client.Addr() != denied {
			t.Errorf("denied datagram reported as %+v, want source-denied from %s", f, denied)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the denied datagram was never reported")
	}
	if got := newClient(t, "127.0.0.11", p.Addr()).roundTrip("hi"); got != "a:hi" {
		t.Errorf("allowed client got %q, want %q", got, "a:hi")
	}
	bad.conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, _, err := bad.conn.ReadFromUDPAddrPort(make([]byte, 64)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("denied client got a reply (%d bytes, %v), want none", n, err)
	}
	for _, c := range picker.Calls() {
		if c.Client == denied {
			t.Errorf("the picker was asked for the denied client: %+v", c)
		}
	}
	if st := p.Stats(); st.SourceDenied != 1 || st.Total != 1 {
		t.Errorf("stats: SourceDenied=%d Total=%d, want 1 and 1", st.SourceDenied, st.Total)
	}
}

// TestSetRefusingClosesAndReopensTheSocket: while refusing nothing is bound to the proxy's
// address, so a connected client's datagram draws ICMP port unreachable (ECONNREFUSED on its next
// read); the sessions end; refusing off binds the address again and the loop serves it.
// Address plan: proxy 127.0.0.1, endpoint 127.0.0.2, client 127.0.0.12 (connected socket).
func TestSetRefusingClosesAndReopensTheSocket(t *testing.T) {
	for _, loops := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d loops", loops), func(t *testing.T) { testSetRefusing(t, loops) })
	}
}

func testSetRefusing(t *testing.T, loops int) {
	p := startProxy(t, newFakePicker(echoServer(t, "127.0.0.2", "a:")), Config{Loops: loops})
	c := newClient(t, "127.0.0.11", p.Addr())
	if got := c.roundTrip("before"); got != "a:before" {
		t.Fatalf("before: %q", got)
	}
	conn, err := net.DialUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.12:0")),
		net.UDPAddrFromAddrPort(p.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })

	for round := range 2 {
		if err := p.SetRefusing(true); err != nil {
			t.Fatalf("round %d: SetRefusing(true): %v", round, err)
		}
		if st := p.Stats(); st.Active != 0 {
			t.Errorf("round %d: %d sessions live while refusing, want 0", round, st.Active)
		}
		if _, err := conn.Write([]byte("ping")); err != nil {
			t.Fatalf("round %d: write: %v", round, err)
		}
		conn.SetReadDeadline(time.Now().Add(waitTimeout))
		if _, err := conn.Read(make([]byte, 64)); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("round %d: read while refusing: %v, want ECONNREFUSED (ICMP port unreachable)", round, err)
		}
		if err := p.SetRefusing(false); err != nil {
			t.Fatalf("round %d: SetRefusing(false): %v", round, err)
		}
		var got string
		testenv.WaitFor(t, "the reopened socket to answer", func() bool {
			conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
			if _, err := conn.Write([]byte("again")); err != nil {
				return false
			}
			buf := make([]byte, 64)
			n, err := conn.Read(buf)
			got = string(buf[:n])
			return err == nil
		})
		if got != "a:again" {
			t.Errorf("round %d: after reopening: %q, want %q", round, got, "a:again")
		}
	}
}
