package portal

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Netlink is the LinkManager of the node: rtnetlink requests for links and addresses, and files
// under /proc/sys for sysctls. It keeps one netlink socket open between operations (opening one
// costs ~0.1 ms, more than the request); Close releases it. Safe for concurrent use; the zero
// value is ready.
type Netlink struct {
	// Do, when set, runs each operation, e.g. on a thread switched into another network namespace
	// (tests pass netns.NS.Do: the socket, opened inside, stays in that namespace, and /proc/sys/net
	// is that of the calling thread's namespace). Nil runs it on the calling goroutine.
	Do func(func() error) error

	mu   sync.Mutex
	conn *nlConn
}

// Close closes the socket, if one is open. The next operation opens a new one.
func (n *Netlink) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.conn == nil {
		return nil
	}
	err := n.conn.Close()
	n.conn = nil
	return err
}

// run runs fn on the shared socket, opening it first if needed. A socket that failed to send or
// receive is dropped, so the next operation starts clean.
func (n *Netlink) run(ctx context.Context, fn func(c *nlConn) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.runPlain(func() error {
		if n.conn == nil {
			c, err := dialNetlink(ctx, 0)
			if err != nil {
				return err
			}
			n.conn = c
		}
		err := fn(n.conn)
		if errors.Is(err, errNetlinkSocket) {
			n.conn.Close()
			n.conn = nil
		}
		return err
	})
}

func (n *Netlink) runPlain(fn func() error) error {
	if n.Do != nil {
		return n.Do(fn)
	}
	return fn()
}

// LinkKind implements LinkManager.
func (n *Netlink) LinkKind(ctx context.Context, name string) (string, error) {
	var kind string
	err := n.run(ctx, func(c *nlConn) error {
		l, err := c.getLink(name)
		kind = l.kind
		return err
	})
	return kind, err
}

// EnsureLink implements LinkManager.
func (n *Netlink) EnsureLink(ctx context.Context, name, kind string) error {
	return n.run(ctx, func(c *nlConn) error {
		l, err := c.getLink(name)
		if errors.Is(err, ErrLinkNotFound) {
			if err := c.addLink(name, kind); err != nil {
				return err
			}
			l, err = c.getLink(name)
		}
		if err != nil {
			return err
		}
		if l.kind != kind {
			return fmt.Errorf("link %s: exists with kind %q, not %q", name, l.kind, kind)
		}
		if l.flags&unix.IFF_UP == 0 {
			return c.setUp(l.index, name)
		}
		return nil
	})
}

// DeleteLink implements LinkManager.
func (n *Netlink) DeleteLink(ctx context.Context, name string) error {
	return n.run(ctx, func(c *nlConn) error {
		l, err := c.getLink(name)
		if err != nil {
			return err
		}
		return c.delLink(l.index, name)
	})
}

// Addrs implements LinkManager.
func (n *Netlink) Addrs(ctx context.Context, name string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	err := n.run(ctx, func(c *nlConn) error {
		l, err := c.getLink(name)
		if err != nil {
			return err
		}
		out, err = c.addrs(l.index)
		return err
	})
	return out, err
}

// AddAddr implements LinkManager.
func (n *Netlink) AddAddr(ctx context.Context, name string, addr netip.Prefix) error {
	return n.run(ctx, func(c *nlConn) error {
		l, err := c.getLink(name)
		if err != nil {
			return err
		}
		if addr.Addr().Unmap().Is6() {
			err = c.addAddr6(l.index, addr)
		} else {
			err = c.changeAddr(unix.RTM_NEWADDR, l.index, addr)
		}
		if errors.Is(err, unix.EEXIST) {
			return nil
		}
		return err
	})
}

// DelAddr implements LinkManager.
func (n *Netlink) DelAddr(ctx context.Context, name string, addr netip.Prefix) error {
	return n.run(ctx, func(c *nlConn) error {
		l, err := c.getLink(name)
		if err != nil {
			return err
		}
		err = c.changeAddr(unix.RTM_DELADDR, l.index, addr)
		if errors.Is(err, unix.EADDRNOTAVAIL) {
			return nil
		}
		return err
	})
}

// Sysctl implements LinkManager.
func (n *Netlink) Sysctl(key string) (string, error) {
	var val string
	err := n.runPlain(func() error {
		b, err := os.ReadFile(sysctlPath(key))
		val = strings.TrimSpace(string(b))
		return err
	})
	if err != nil {
		return "", fmt.Errorf("sysctl %s: %w", key, err)
	}
	return val, nil
}

// SetSysctl implements LinkManager.
func (n *Netlink) SetSysctl(key, value string) error {
	err := n.runPlain(func() error {
		return os.WriteFile(sysctlPath(key), []byte(value+"\n"), 0o644)
	})
	if err != nil {
		return fmt.Errorf("sysctl %s=%s: %w", key, value, err)
	}
	return nil
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", filepath.Clean("/"+key))
}
