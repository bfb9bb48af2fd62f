package tcp

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxyprotocol"
)

// Address plan: the package's (helpers_test.go); nginx listens on 127.0.0.5 with proxy_protocol.

// headerEcho is an endpoint that reads a PROXY header with our own parser, reports it, then
// echoes what follows.
func headerEcho(got chan<- proxyprotocol.Header) func(*net.TCPConn) {
	return func(c *net.TCPConn) {
		buf := make([]byte, 0, 256)
		for {
			var chunk [256]byte
			n, err := c.Read(chunk[:])
			buf = append(buf, chunk[:n]...)
			h, _, hn, perr := proxyprotocol.Parse(buf)
			if perr == nil {
				got <- h
				c.Write(buf[hn:])
				echo(c)
				return
			}
			if err != nil || !strings.Contains(perr.Error(), "incomplete") {
				close(got)
				return
			}
		}
	}
}

func TestProxyProtocolHeaderPrecedesClientBytes(t *testing.T) {
	for _, v := range []proxyprotocol.Version{proxyprotocol.V1, proxyprotocol.V2} {
		for _, m := range modes {
			t.Run(v.String()+"/"+m.name, func(t *testing.T) {
				got := make(chan proxyprotocol.Header, 1)
				ep := serve(t, "127.0.0.3", headerEcho(got))
				p := startProxy(t, &fakePicker{eps: []netip.AddrPort{ep}}, Config{ProxyProtocol: v, ParkAfter: m.parkAfter})
				c := dial(t, p)
				roundTrip(t, c, "first client bytes")
				h, ok := <-got
				if !ok {
					t.Fatal("the endpoint did not read a PROXY header first")
				}
				// No NAT on loopback: the service address is the proxy's own.
				want := proxyprotocol.Header{Source: c.LocalAddr().(*net.TCPAddr).AddrPort(), Destination: p.Addr()}
				if h != want {
					t.Errorf("header %+v, want %+v", h, want)
				}
				// Counted once the bytes are written, which may be after the echo is back.
				testenv.WaitFor(t, "the client's bytes to be counted", func() bool { return p.Stats().BytesToEndpoint >= uint64(len("first client bytes")) })
				if st := p.Stats(); st.BytesToEndpoint != uint64(len("first client bytes")) {
					t.Errorf("bytes to endpoint %d, want the client's %d only (the header is not the client's)", st.BytesToEndpoint, len("first client bytes"))
				}
			})
		}
	}
}

func TestProxyProtocolIPv6(t *testing.T) {
	ln, err := net.ListenTCP("tcp6", &net.TCPAddr{IP: net.IPv6loopback})
	if err != nil {
		testenv.Unavailable(t, "no IPv6 loopback here: %v", err)
	}
	ln.Close()
	got := make(chan proxyprotocol.Header, 1)
	ep := serve(t, "::1", headerEcho(got))
	p := New(testName, &fakePicker{eps: []netip.AddrPort{ep}}, Config{Logger: testLogger(t), ProxyProtocol: proxyprotocol.V2})
	if err := p.Listen(netip.MustParseAddrPort("[::1]:0")); err != nil {
		t.Fatalf("Listen: %v", err)
	}
	go p.Run(t.Context())
	defer p.Shutdown()
	c, err := net.DialTCP("tcp6", nil, net.TCPAddrFromAddrPort(p.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	roundTrip(t, c, "hello over IPv6")
	want := proxyprotocol.Header{Source: c.LocalAddr().(*net.TCPAddr).AddrPort(), Destination: p.Addr()}
	if h := <-got; h != want {
		t.Errorf("header %+v, want %+v", h, want)
	}
}

// TestProxyProtocolNginxSeesTheClient proxies HTTP requests through the proxy to a real nginx
// that expects the PROXY protocol, and checks that nginx reports the real client's address and
// port and the address the client connected to, for both versions.
func TestProxyProtocolNginxSeesTheClient(t *testing.T) {
	nginx := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.5"), testenv.FreeTCPPort(t, "127.0.0.5"))
	testenv.StartNginxProxyProtocol(t, nginx, nil, nil)
	for _, v := range []proxyprotocol.Version{proxyprotocol.V1, proxyprotocol.V2} {
		t.Run(v.String(), func(t *testing.T) {
			p := startProxy(t, &fakePicker{eps: []netip.AddrPort{nginx}}, Config{ProxyProtocol: v})
			for range 2 { // two connections: each gets its own header
				c := dial(t, p)
				status, body := httpGet(t, c)
				want := fmt.Sprintf("%s %s", c.LocalAddr().(*net.TCPAddr).AddrPort(), p.Addr())
				if status != http.StatusOK || body != want {
					t.Errorf("nginx answered %d %q, want 200 %q", status, body, want)
				}
				c.Close()
			}
		})
	}
}

// httpGet sends one HTTP/1.0 request on c and reads the answer.
func httpGet(t *testing.T, c net.Conn) (int, string) {
	t.Helper()
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: test\r\n\r\n"); err != nil {
		t.Fatalf("write request: %v", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return resp.StatusCode, string(b)
}

// stripEcho is an endpoint that drops a PROXY header if the connection starts with one, then
// echoes: the same endpoint work with and without the header.
func stripEcho(c *net.TCPConn) {
	var chunk [512]byte
	n, err := c.Read(chunk[:])
	if err != nil {
		return
	}
	rest := chunk[:n]
	if _, _, hn, err := proxyprotocol.Parse(rest); err == nil {
		rest = rest[hn:]
	}
	if len(rest) > 0 {
		c.Write(rest)
	}
	echo(c)
}

// BenchmarkConnRateProxyProtocol is the per-connection cost of the PROXY header (one extra
// write, and the getsockopt/getsockname for the service address), against the same proxy
// without it, in one run: connect, a 4-byte request and its echo, close.
//
//	go test -run '^$' -bench ConnRateProxyProtocol -count 5 ./tcp/
func BenchmarkConnRateProxyProtocol(b *testing.B) {
	ep := serve(b, "127.0.0.3", stripEcho)
	for _, v := range []proxyprotocol.Version{proxyprotocol.Off, proxyprotocol.V1, proxyprotocol.V2} {
		name := v.String()
		if v == proxyprotocol.Off {
			name = "off"
		}
		p := benchProxy(b, ep, Config{ProxyProtocol: v})
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			stop := reportCPU(b)
			buf := make([]byte, 4)
			for b.Loop() {
				c, err := net.Dial("tcp4", p.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				c.Write([]byte("ping"))
				if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
					b.Fatalf("echo %q, %v", buf, err)
				}
				c.Close()
			}
			stop()
		})
	}
}
