package healthcheck

// Address plan: as service_test.go, one health check port on 127.0.0.1 at a port the kernel
// reported free; raw TCP clients from loopback, 127.0.0.1 and, as a second client, 127.0.0.2.
// The client table's own test uses 192.0.2.1 and 10.0.0.0/8 as keys only.

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/time/rate"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// limitedPort opens svcA's health check port with limits and returns its address.
func limitedPort(t *testing.T, l Limits) string {
	t.Helper()
	var f failures
	cfg := loopbackConfig(&f, nil)
	cfg.Limits = l
	s := NewServiceHealthServer(cfg)
	t.Cleanup(s.Close)
	port := freePort(t)
	s.SyncServices(map[service.NamespacedName]uint16{svcA: port})
	if errs := f.take(); len(errs) > 0 {
		t.Fatal(errs)
	}
	s.SyncEndpoints(map[service.NamespacedName]int{svcA: 1})
	return netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port).String()
}

// rawConn is one client connection that sends requests by hand.
type rawConn struct {
	net.Conn
	r *bufio.Reader
}

func dialRaw(t *testing.T, addr string) *rawConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{Conn: c, r: bufio.NewReader(c)}
}

// do sends a GET (with extra header lines) and reads the answer within wait.
func (c *rawConn) do(extra string, wait time.Duration) (*http.Response, error) {
	_ = c.SetDeadline(time.Now().Add(wait))
	if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: lb\r\n"+extra+"\r\n"); err != nil {
		return nil, err
	}
	resp, err := http.ReadResponse(c.r, nil)
	if err != nil {
		return nil, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp, nil
}

func TestHealthCheckPortLimits(t *testing.T) {
	t.Run("headers over the limit are refused with 431", func(t *testing.T) {
		addr := limitedPort(t, Limits{})
		c := dialRaw(t, addr)
		resp, err := c.do("X-Pad: "+strings.Repeat("a", 16<<10)+"\r\n", 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("a 16 KiB header got %d, want 431", resp.StatusCode)
		}
		// A normal probe still gets its answer.
		if resp, err := dialRaw(t, addr).do("", 10*time.Second); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("probe after a refused one: %v %v", resp, err)
		}
	})

	t.Run("requests beyond the token bucket get 429 and the connection closes", func(t *testing.T) {
		addr := limitedPort(t, Limits{RequestsPerSecond: 0.001, Burst: 3}) // no refill within the test
		c := dialRaw(t, addr)
		for i := range 3 {
			if resp, err := c.do("", 10*time.Second); err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("request %d within the burst: %v %v", i+1, resp, err)
			}
		}
		resp, err := c.do("", 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusTooManyRequests || !resp.Close {
			t.Fatalf("request beyond the burst: %d close=%v, want 429 and the connection closed", resp.StatusCode, resp.Close)
		}
		// Another connection shares the port's bucket.
		if resp, err := dialRaw(t, addr).do("", 10*time.Second); err != nil || resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("a new connection after the burst: %v %v, want 429", resp, err)
		}
	})

	t.Run("a request with a body closes the connection instead of draining it", func(t *testing.T) {
		addr := limitedPort(t, Limits{})
		c := dialRaw(t, addr)
		// do ends the headers with a blank line of its own: here it ends the 100-byte body.
		resp, err := c.do("Content-Length: 100\r\n\r\n"+strings.Repeat("b", 98), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if !resp.Close {
			t.Fatalf("answer to a request with a body keeps the connection (%d)", resp.StatusCode)
		}
	})

	t.Run("at most MaxConnections are served at once; the next waits in the accept queue", func(t *testing.T) {
		addr := limitedPort(t, Limits{MaxConnections: 3})
		var open []*rawConn
		for i := range 3 {
			c := dialRaw(t, addr)
			if resp, err := c.do("", 10*time.Second); err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("connection %d: %v %v", i+1, resp, err)
			}
			open = append(open, c)
		}
		fourth := dialRaw(t, addr) // the kernel completes the handshake; nobody accepts it yet
		_, err := fourth.do("", 300*time.Millisecond)
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a fourth connection while three are open: %v, want no answer", err)
		}
		open[0].Close()
		_ = fourth.SetDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(fourth.r, nil)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("the fourth connection once one closed: %v %v", resp, err)
		}
		resp.Body.Close()
	})

	t.Run("a request that never finishes its headers is closed at the read timeout", func(t *testing.T) {
		addr := limitedPort(t, Limits{ReadTimeout: 200 * time.Millisecond})
		c := dialRaw(t, addr)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nX-Slow: "); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadAll(c); err != nil {
			t.Fatalf("the server kept a half-sent request open: %v", err)
		}
	})
}

// dialFrom is dialRaw from the local address from (another loopback address: another client).
func dialFrom(t *testing.T, from, addr string) *rawConn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{Conn: c, r: bufio.NewReader(c)}
}

// TestHealthCheckPortPerClientLimits: a load balancer probing from 127.0.0.2 still gets its 200s
// while another client, 127.0.0.1, floods the port. The buckets' clock stands still, so nothing
// refills during the test and only the per-client limits can tell the two apart.
func TestHealthCheckPortPerClientLimits(t *testing.T) {
	t.Run("one client's request flood leaves another's probes at 200", func(t *testing.T) {
		addr := limitedPort(t, Limits{Clock: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))})
		const floods = 200 // four times the port's burst
		limited := make(chan struct{})
		flood := make(chan [2]int, 1) // 200s, 429s
		go func() {
			var ok, refused int
			var c *rawConn
			for range floods {
				if c == nil {
					conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
					if err != nil {
						break
					}
					c = &rawConn{Conn: conn, r: bufio.NewReader(conn)}
				}
				resp, err := c.do("", 10*time.Second)
				if err != nil {
					break
				}
				switch resp.StatusCode {
				case http.StatusOK:
					ok++
				case http.StatusTooManyRequests:
					if refused++; refused == 1 {
						close(limited)
					}
				}
				if resp.Close {
					c.Close()
					c = nil
				}
			}
			if c != nil {
				c.Close()
			}
			flood <- [2]int{ok, refused}
		}()
		select {
		case <-limited:
		case <-time.After(10 * time.Second):
			t.Fatal("the flooding client was never refused")
		}
		probe := dialFrom(t, "127.0.0.2", addr)
		for i := range 10 {
			resp, err := probe.do("", 10*time.Second)
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("probe %d from 127.0.0.2 during the flood: %v %v, want 200", i+1, resp, err)
			}
		}
		got := <-flood
		if got[0] != DefaultClientBurst || got[0]+got[1] != floods {
			t.Errorf("the flooding client got %d answers of 200 and %d of 429, want its burst (%d) and %d", got[0], got[1], DefaultClientBurst, floods-DefaultClientBurst)
		}
	})

	t.Run("one client's connections cannot take the port's slots", func(t *testing.T) {
		addr := limitedPort(t, Limits{MaxConnections: 4, ClientConnections: 2})
		var served int
		for i := range 6 {
			c := dialRaw(t, addr) // held open until the test ends
			resp, err := c.do("", 2*time.Second)
			switch {
			case err == nil && resp.StatusCode == http.StatusOK:
				served++
			case err == nil:
				t.Fatalf("connection %d of the flooding client: %d", i+1, resp.StatusCode)
			}
		}
		if served != 2 {
			t.Errorf("the flooding client has %d connections served at once, want its share of 2", served)
		}
		if resp, err := dialFrom(t, "127.0.0.2", addr).do("", 10*time.Second); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("a probe from 127.0.0.2 while 127.0.0.1 holds its connections: %v %v, want 200", resp, err)
		}
	})
}

// TestClientTableIsBounded: addresses beyond the table's size push out the least recently seen,
// so a flood from many addresses cannot grow it; an address with an open connection stays.
func TestClientTableIsBounded(t *testing.T) {
	c := newClients(8, rate.Inf, 1, 1)
	now := time.Unix(1_700_000_000, 0)
	holder := netip.MustParseAddr("192.0.2.1")
	if !c.open(holder) {
		t.Fatal("first connection of a new client refused")
	}
	for i := range 10_000 {
		a := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		if !c.allow(a, now) {
			t.Fatalf("request of new client %v refused", a)
		}
		if n := c.size(); n > 8 {
			t.Fatalf("after %d clients the table holds %d, want at most 8", i+1, n)
		}
	}
	if c.open(holder) {
		t.Error("a client with an open connection was forgotten: its second connection was counted as its first")
	}
	c.closed(holder)
	if !c.open(holder) {
		t.Error("the client's connection closed, yet a new one is refused")
	}
}
