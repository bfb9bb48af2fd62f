package iouring

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	ring "github.com/kube-portal-proxy/kube-portal-proxy/internal/iouring"
)

// Address plan: the forwarder listens on 127.0.0.1 (kernel-chosen port); the endpoint listens on
// 127.0.0.1 too (another kernel-chosen port). Loopback only.

// requireIOURing fails (KPP_E2E_REQUIRE=1) or skips the test where io_uring is not available.
func requireIOURing(t *testing.T) {
	t.Helper()
	err := ring.Probe()
	if err == nil {
		return
	}
	if os.Getenv("KPP_E2E_REQUIRE") == "1" {
		t.Fatalf("io_uring unavailable: %v", err)
	}
	t.Skipf("io_uring unavailable: %v", err)
}

// echoAfterEOF answers each connection with everything it read, once the client half-closed.
func echoAfterEOF(t *testing.T) netip.AddrPort {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c)
				c.Write(b)
			}()
		}
	}()
	return netip.MustParseAddrPort(ln.Addr().String())
}

func startForwarder(t *testing.T, ep netip.AddrPort) netip.AddrPort {
	f, bound, err := New([]Route{{Listen: netip.MustParseAddrPort("127.0.0.1:0"), Endpoint: ep}}, 2)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run() }()
	t.Cleanup(func() {
		f.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after Close")
		}
	})
	return bound[0]
}

func TestForwarder(t *testing.T) {
	requireIOURing(t)
	addr := startForwarder(t, echoAfterEOF(t))

	t.Run("half-close: the reply flows after the client's FIN", func(t *testing.T) {
		for i := range 50 {
			// Larger than one buffer for some, so partial reads and several sends are exercised.
			msg := bytes.Repeat([]byte(fmt.Sprintf("request %d;", i)), 1+i*300)
			c, err := net.Dial("tcp4", addr.String())
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			c.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(c)
			c.Close()
			if err != nil {
				t.Fatalf("connection %d: read: %v", i, err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatalf("connection %d: got %d bytes back, want the %d sent", i, len(got), len(msg))
			}
		}
	})
}

func TestForwarderEndpointRefuses(t *testing.T) {
	requireIOURing(t)
	// A port nobody listens on: bind one, note it, close it.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := netip.MustParseAddrPort(ln.Addr().String())
	ln.Close()
	addr := startForwarder(t, dead)

	c, err := net.Dial("tcp4", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = c.Read(make([]byte, 1))
	var ne net.Error
	if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
		t.Fatalf("read from a client whose endpoint refused: %v, want EOF or reset", err)
	}
}
