package netns

import (
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// Address plan: namespace "a" 10.123.0.1/24 (veth a0) <-> namespace "b" 10.123.0.2/24 (veth b0);
// "b" routes 10.124.0.0/16 via 10.123.0.1.

func TestLab(t *testing.T) {
	lab := NewTestLab(t)
	a := lab.MustAdd(t, "a")
	b := lab.MustAdd(t, "b")
	if err := Link(t.Context(),
		End{NS: a, Dev: "a0", Addr: netip.MustParsePrefix("10.123.0.1/24")},
		End{NS: b, Dev: "b0", Addr: netip.MustParsePrefix("10.123.0.2/24")}); err != nil {
		t.Fatal(err)
	}
	if err := b.AddRoute(t.Context(), netip.MustParsePrefix("10.124.0.0/16"), netip.MustParseAddr("10.123.0.1"), ""); err != nil {
		t.Fatal(err)
	}

	t.Run("names_share_the_lab_prefix", func(t *testing.T) {
		if !strings.HasPrefix(a.Name, Prefix) || !strings.HasPrefix(b.Name, lab.Prefix()) {
			t.Errorf("names %q %q, want prefix %q", a.Name, b.Name, lab.Prefix())
		}
	})

	t.Run("route_is_inside_the_namespace", func(t *testing.T) {
		if got := b.MustExec(t, "ip", "route", "show", "10.124.0.0/16"); !strings.Contains(got, "via 10.123.0.1") {
			t.Errorf("route in %s: got %q, want via 10.123.0.1", b.Name, got)
		}
	})

	t.Run("socket_made_in_Do_lives_in_the_namespace", func(t *testing.T) {
		var ln net.Listener
		if err := b.Do(func() (err error) {
			ln, err = net.Listen("tcp", "10.123.0.2:0")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("hi"))
			c.Close()
		}()
		var got []byte
		if err := a.Do(func() error {
			c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			got, err = io.ReadAll(c)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if string(got) != "hi" {
			t.Errorf("read %q, want %q", got, "hi")
		}
	})

	t.Run("loopback_is_private_to_each_namespace", func(t *testing.T) {
		var ln net.Listener
		if err := b.Do(func() (err error) {
			ln, err = net.Listen("tcp", "127.0.0.1:0")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		err := a.Do(func() error {
			c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
			if err == nil {
				c.Close()
			}
			return err
		})
		if err == nil {
			t.Errorf("dial %s from %s succeeded, want refused (listener is in %s)", ln.Addr(), a.Name, b.Name)
		}
	})
}

func TestLabCloseDeletesNamespaces(t *testing.T) {
	SkipUnlessRoot(t)
	lab, err := NewLab()
	if err != nil {
		t.Fatal(err)
	}
	ns, err := lab.Add(t.Context(), "gone")
	if err != nil {
		lab.Close()
		t.Fatal(err)
	}
	if err := lab.Close(); err != nil {
		t.Fatal(err)
	}
	out, err := run(t.Context(), "ip", "netns", "list")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), ns.Name) {
		t.Errorf("ip netns list still shows %s after Close:\n%s", ns.Name, out)
	}
}
