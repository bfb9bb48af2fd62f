package testenv

import (
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
)

// ServeTCP accepts connections on ln until the test ends, each handled on its own goroutine and
// closed when handle returns. The cleanup closes ln and waits for every handler.
func ServeTCP(t testing.TB, ln net.Listener, handle func(net.Conn)) {
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				handle(c)
			})
		}
	})
}

// EchoTCP echoes every TCP connection to the address it returns, on 127.0.0.1, until the test
// ends.
func EchoTCP(t testing.TB) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ServeTCP(t, ln, func(c net.Conn) { _, _ = io.Copy(c, c) })
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// EchoUDP answers every datagram to the address it returns, on 127.0.0.1, with the same bytes
// until the test ends.
func EchoUDP(t testing.TB) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	EchoPackets(t, pc)
	return pc.LocalAddr().(*net.UDPAddr).AddrPort()
}

// EchoPackets answers every datagram to pc with the same bytes until the test ends; the cleanup
// closes pc and waits for the loop.
func EchoPackets(t testing.TB, pc net.PacketConn) {
	done := make(chan struct{})
	t.Cleanup(func() { pc.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:n], from)
		}
	}()
}

// httpClient bounds every request; no connection is kept, so a server under test can stop at once.
var httpClient = &http.Client{Timeout: WaitTimeout, Transport: &http.Transport{DisableKeepAlives: true}}

// Get fetches url and returns the status code and body; a failed request fails the test.
func Get(t testing.TB, url string) (status int, body string) {
	t.Helper()
	resp, err := httpClient.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: read body: %v", url, err)
	}
	return resp.StatusCode, string(b)
}

// FreeTCPPort returns a TCP port on the loopback address ip that was free a moment ago, for a
// socket a test will open itself (a proxy listening on a loopback "service IP").
func FreeTCPPort(t testing.TB, ip string) uint16 {
	t.Helper()
	ln, err := net.Listen("tcp4", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).AddrPort().Port()
}
