package tcp

import (
	"errors"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// dialFrom connects to the proxy from the loopback address src.
func dialFrom(t *testing.T, src string, p *Proxy) (*net.TCPConn, error) {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp4", p.Addr().String())
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c.(*net.TCPConn), nil
}

// TestAllowDeniesBeforeAnyPick: a client the allow-check refuses is reset before the picker is
// asked (no endpoint sees it), counted in SourceDenied and reported as source-denied; an allowed
// client is proxied as usual.
// Address plan: denied client 127.0.0.5, allowed client 127.0.0.1, endpoint on 127.0.0.3.
func TestAllowDeniesBeforeAnyPick(t *testing.T) {
	ep := serve(t, "127.0.0.3", echo)
	picker := &fakePicker{eps: []netip.AddrPort{ep}}
	denied := netip.MustParseAddr("127.0.0.5")
	ended := make(closedCh, 4)
	p := startProxy(t, picker, Config{
		Allow: func(client netip.Addr) bool { return client != denied },
		OnEnd: ended.onClose,
	})

	c, err := dialFrom(t, "127.0.0.5", p)
	if err == nil {
		_, err = c.Read(make([]byte, 1))
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("denied client: %v, want a reset", err)
	}
	info := ended.next(t)
	if info.End != flow.SourceDenied || info.Client.Addr() != denied || info.Endpoint.IsValid() {
		t.Errorf("denied client's flow = %+v, want source-denied from %s with no endpoint", info, denied)
	}
	for _, pk := range picker.picks() {
		if pk.client == denied {
			t.Errorf("the picker was asked for the denied client: %+v", pk)
		}
	}

	ok, err := dialFrom(t, "127.0.0.1", p)
	if err != nil {
		t.Fatalf("allowed client: %v", err)
	}
	roundTrip(t, ok, "hello")
	st := p.Stats()
	if st.SourceDenied != 1 || st.Total != 1 {
		t.Errorf("stats: SourceDenied=%d Total=%d, want 1 and 1 (the denied client is not an accepted flow)", st.SourceDenied, st.Total)
	}
}

// TestSetRefusingClosesAndReopensTheListener: while refusing, nothing listens on the proxy's
// address, so a connect fails at once with ECONNREFUSED; an established connection keeps
// working; refusing off listens again on the same address and the accept loop serves it.
// Address plan: proxy on 127.0.0.1, endpoint on 127.0.0.3.
func TestSetRefusingClosesAndReopensTheListener(t *testing.T) {
	ep := serve(t, "127.0.0.3", echo)
	p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{})
	kept := dial(t, p)
	roundTrip(t, kept, "before")

	for round := range 2 { // twice: the loop must survive more than one close and reopen
		if err := p.SetRefusing(true); err != nil {
			t.Fatalf("round %d: SetRefusing(true): %v", round, err)
		}
		start := time.Now()
		if c, err := dialFrom(t, "127.0.0.1", p); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("round %d: connect while refusing: %v (conn %v), want ECONNREFUSED", round, err, c)
		} else if d := time.Since(start); d > time.Second {
			t.Errorf("round %d: refused after %v, want at once", round, d)
		}
		roundTrip(t, kept, "during")

		if err := p.SetRefusing(false); err != nil {
			t.Fatalf("round %d: SetRefusing(false): %v", round, err)
		}
		var c *net.TCPConn
		testenv.WaitFor(t, "the reopened listener to serve", func() bool {
			var err error
			c, err = dialFrom(t, "127.0.0.1", p)
			return err == nil
		})
		roundTrip(t, c, "after")
	}
	roundTrip(t, kept, "still")
}
