package tcp

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// TestHandOver: a successor's proxy adopts the predecessor's listening socket, and a predecessor
// that stops accepting finishes its connections before it reports drained.
func TestHandOver(t *testing.T) {
	t.Run("an adopted listener serves the connection queued before the hand-over", func(t *testing.T) {
		backend := serve(t, "127.0.0.3", echo)
		old, err := net.ListenTCP("tcp4", net.TCPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.1:0")))
		if err != nil {
			t.Fatal(err)
		}
		addr := old.Addr().(*net.TCPAddr).AddrPort()
		client, err := net.DialTCP("tcp4", nil, net.TCPAddrFromAddrPort(addr)) // waits in the queue
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		f, err := old.File() // a duplicate, as SCM_RIGHTS would deliver
		if err != nil {
			t.Fatal(err)
		}
		fd, err := unix.Dup(int(f.Fd()))
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		var asked []netip.AddrPort
		p := New(testName, &fakePicker{eps: []netip.AddrPort{backend}}, Config{Logger: testLogger(t),
			Adopt: func(a netip.AddrPort) (int, bool) { asked = append(asked, a); return fd, true }})
		if err := p.Listen(addr); err != nil {
			t.Fatalf("Listen with an adopted socket: %v", err)
		}
		old.Close() // the predecessor lets go; the socket lives on in p
		if p.Addr() != addr || len(asked) != 1 || asked[0] != addr || !p.Adopted() {
			t.Fatalf("Addr() = %v, Adopt asked for %v, Adopted() = %v; want %v, adopted", p.Addr(), asked, p.Adopted(), addr)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- p.Run(ctx) }()
		defer func() { cancel(); p.Shutdown(); <-done }()
		client.SetDeadline(time.Now().Add(20 * time.Second))
		roundTrip(t, client, "queued before the hand-over")
	})

	t.Run("a closed proxy finishes its connections, then is drained", func(t *testing.T) {
		backend := serve(t, "127.0.0.3", echo)
		p := startProxy(t, &fakePicker{eps: []netip.AddrPort{backend}}, Config{})
		if p.Adopted() {
			t.Error("Adopted() without an Adopt")
		}
		c := dial(t, p)
		roundTrip(t, c, "before")
		p.Close()
		select {
		case <-p.Drained():
			t.Fatal("drained while a connection is open")
		default:
		}
		roundTrip(t, c, "after the proxy stopped accepting")
		c.CloseWrite() // the exchange ends: the backend echoes the FIN, the proxy closes both legs
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatal("read after the FIN returned data")
		}
		testenv.WaitFor(t, "the proxy to report drained", func() bool {
			select {
			case <-p.Drained():
				return true
			default:
				return false
			}
		})
	})
}
