package testenv

import (
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"
)

func TestWaitForReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	WaitFor(t, "the third call", func() bool { return calls.Add(1) == 3 })
	if n := calls.Load(); n != 3 {
		t.Errorf("cond called %d times, want 3 (polling stops once it holds)", n)
	}
}

func TestRequired(t *testing.T) {
	for _, tt := range []struct {
		value string
		want  bool
	}{{"", false}, {"0", false}, {"1", true}, {"yes", true}} {
		t.Setenv(EnvRequire, tt.value)
		if got := Required(); got != tt.want {
			t.Errorf("Required() with %s=%q = %v, want %v", EnvRequire, tt.value, got, tt.want)
		}
	}
}

// recorder is a testing.TB that records how a test ended instead of ending it.
type recorder struct {
	testing.TB
	ended string
}

func (r *recorder) Helper()               {}
func (r *recorder) Fatalf(string, ...any) { r.ended = "fail" }
func (r *recorder) Skipf(string, ...any)  { r.ended = "skip" }

func TestUnavailableSkipsOrFailsWhenRequired(t *testing.T) {
	for _, tt := range []struct {
		require, want string
	}{{"", "skip"}, {"0", "skip"}, {"1", "fail"}} {
		t.Setenv(EnvRequire, tt.require)
		r := &recorder{}
		Unavailable(r, "no %s here", "IPv6")
		if r.ended != tt.want {
			t.Errorf("Unavailable with %s=%q: the test would %s, want %s", EnvRequire, tt.require, r.ended, tt.want)
		}
	}
}

func TestEchoServersAnswerWithTheSameBytes(t *testing.T) {
	for _, tt := range []struct {
		network string
		addr    netip.AddrPort
	}{{"tcp", EchoTCP(t)}, {"udp", EchoUDP(t)}} {
		c, err := net.Dial(tt.network, tt.addr.String())
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(WaitTimeout))
		if _, err := c.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 16)
		n, err := c.Read(buf)
		if got := string(buf[:n]); err != nil || got != "hello" {
			t.Errorf("%s echo answered %q, %v; want %q", tt.network, got, err, "hello")
		}
		c.Close()
	}
}

func TestAddrsOfNothingIsNil(t *testing.T) {
	if got := Addrs(); got != nil {
		t.Errorf("Addrs() = %v, want nil", got)
	}
	if got := Addrs("10.0.0.1", "::1"); len(got) != 2 || got[1] != netip.IPv6Loopback() {
		t.Errorf("Addrs(10.0.0.1, ::1) = %v", got)
	}
}
