// Package netns builds throwaway network namespaces for tests: named namespaces with a unique
// prefix, veth links between them, routes, commands run inside (`ip netns exec`) and Go code run on
// an OS thread switched into a namespace, so rule-installing tests never touch the root namespace.
package netns

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// Prefix starts the name of every namespace this package creates, so a leftover is easy to spot.
const Prefix = "kpp-"

// SkipUnlessRoot skips a test that needs to create namespaces when it does not run as root, or
// fails it when KPP_E2E_REQUIRE says every test must run (testenv.Unavailable).
func SkipUnlessRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Unavailable(t, "needs root to create network namespaces (run the tests as root to cover real iptables)")
	}
}

// NewTestPair creates a lab of two namespaces for t, a client and a node, on one veth pair:
// client 10.100.0.2/24 on c0, node 10.100.0.1/24 on n0. The lab is deleted at t's cleanup.
func NewTestPair(t testing.TB) (client, node *NS) {
	t.Helper()
	lab := NewTestLab(t)
	client, node = lab.MustAdd(t, "client"), lab.MustAdd(t, "node")
	if err := Link(t.Context(),
		End{NS: client, Dev: "c0", Addr: netip.MustParsePrefix("10.100.0.2/24")},
		End{NS: node, Dev: "n0", Addr: netip.MustParsePrefix("10.100.0.1/24")}); err != nil {
		t.Fatal(err)
	}
	return client, node
}

// Lab is a group of namespaces sharing one random prefix ("kpp-<random>-"), deleted together.
type Lab struct {
	prefix string

	mu    sync.Mutex
	names []string
}

// NewLab returns an empty lab with a fresh prefix. It creates nothing yet.
func NewLab() (*Lab, error) {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("netns: random prefix: %w", err)
	}
	return &Lab{prefix: Prefix + hex.EncodeToString(b[:]) + "-"}, nil
}

// NewTestLab is NewLab for tests: it skips when not root and deletes every namespace at cleanup.
func NewTestLab(t testing.TB) *Lab {
	t.Helper()
	SkipUnlessRoot(t)
	lab, err := NewLab()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := lab.Close(); err != nil {
			t.Errorf("netns cleanup: %v", err)
		}
	})
	return lab
}

// Prefix is this lab's namespace name prefix.
func (l *Lab) Prefix() string { return l.prefix }

// Add creates the namespace "<prefix><role>" with its loopback up.
func (l *Lab) Add(ctx context.Context, role string) (*NS, error) {
	ns := &NS{Name: l.prefix + role}
	if _, err := run(ctx, "ip", "netns", "add", ns.Name); err != nil {
		return nil, fmt.Errorf("netns %s: create: %w", ns.Name, err)
	}
	l.mu.Lock()
	l.names = append(l.names, ns.Name)
	l.mu.Unlock()
	if _, err := ns.Exec(ctx, "ip", "link", "set", "lo", "up"); err != nil {
		return nil, fmt.Errorf("netns %s: loopback up: %w", ns.Name, err)
	}
	return ns, nil
}

// MustAdd is Add for tests.
func (l *Lab) MustAdd(t testing.TB, role string) *NS {
	t.Helper()
	ns, err := l.Add(t.Context(), role)
	if err != nil {
		t.Fatal(err)
	}
	return ns
}

// Close deletes every namespace of the lab (and with them their veth ends and rules).
func (l *Lab) Close() error {
	l.mu.Lock()
	names := l.names
	l.names = nil
	l.mu.Unlock()
	var errs []error
	for _, name := range names {
		if _, err := run(context.Background(), "ip", "netns", "delete", name); err != nil {
			errs = append(errs, fmt.Errorf("netns %s: delete: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// NS is one named network namespace.
type NS struct {
	Name string
}

// Exec runs a command inside the namespace (`ip netns exec NAME ...`) and returns its stdout.
func (n *NS) Exec(ctx context.Context, args ...string) ([]byte, error) {
	return run(ctx, append([]string{"ip", "netns", "exec", n.Name}, args...)...)
}

// MustExec is Exec for tests; it returns stdout as a string.
func (n *NS) MustExec(t testing.TB, args ...string) string {
	t.Helper()
	out, err := n.Exec(t.Context(), args...)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// CommandPrefix is the argv prefix that runs a command inside the namespace.
func (n *NS) CommandPrefix() []string { return []string{"ip", "netns", "exec", n.Name} }

// AddRoute adds a route inside the namespace: to dst via gw, or straight out of dev when gw is
// the zero Addr.
func (n *NS) AddRoute(ctx context.Context, dst netip.Prefix, gw netip.Addr, dev string) error {
	args := []string{"ip", "route", "add", dst.String()}
	if gw.IsValid() {
		args = append(args, "via", gw.String())
	}
	if dev != "" {
		args = append(args, "dev", dev)
	}
	if _, err := n.Exec(ctx, args...); err != nil {
		return fmt.Errorf("netns %s: route %s: %w", n.Name, dst, err)
	}
	return nil
}

// End is one side of a veth link: the namespace, the interface name inside it and its address.
type End struct {
	NS   *NS
	Dev  string
	Addr netip.Prefix
}

// Link creates a veth pair between a.NS and b.NS, addresses both ends and brings them up.
// IPv6 addresses skip duplicate address detection so they are usable at once.
func Link(ctx context.Context, a, b End) error {
	if _, err := run(ctx, "ip", "link", "add", a.Dev, "netns", a.NS.Name, "type", "veth",
		"peer", "name", b.Dev, "netns", b.NS.Name); err != nil {
		return fmt.Errorf("netns: veth %s/%s - %s/%s: %w", a.NS.Name, a.Dev, b.NS.Name, b.Dev, err)
	}
	for _, e := range []End{a, b} {
		if e.Addr.IsValid() {
			args := []string{"ip", "addr", "add", e.Addr.String(), "dev", e.Dev}
			if e.Addr.Addr().Is6() {
				args = append(args, "nodad")
			}
			if _, err := e.NS.Exec(ctx, args...); err != nil {
				return fmt.Errorf("netns %s: address %s on %s: %w", e.NS.Name, e.Addr, e.Dev, err)
			}
		}
		if _, err := e.NS.Exec(ctx, "ip", "link", "set", e.Dev, "up"); err != nil {
			return fmt.Errorf("netns %s: %s up: %w", e.NS.Name, e.Dev, err)
		}
	}
	return nil
}

// Do runs fn on an OS thread switched into the namespace, so sockets fn creates belong to it (they
// stay there after Do returns). Goroutines fn starts do NOT run in the namespace. fn runs on a
// goroutine of its own: if switching the thread back fails, that goroutine exits with its thread
// still locked, and the runtime discards the thread instead of reusing it in the wrong namespace.
func (n *NS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		errc <- n.doLocked(fn)
	}()
	return <-errc
}

func (n *NS) doLocked(fn func() error) (err error) {
	runtime.LockOSThread()
	orig, err := os.Open(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()))
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("netns %s: open current namespace: %w", n.Name, err)
	}
	defer orig.Close()
	target, err := os.Open("/run/netns/" + n.Name)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("netns %s: open: %w", n.Name, err)
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("netns %s: enter: %w", n.Name, err)
	}
	defer func() {
		if rerr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); rerr != nil {
			// Keep the thread locked: the goroutine ends and the runtime kills the thread.
			err = errors.Join(err, fmt.Errorf("netns %s: restore namespace: %w", n.Name, rerr))
			return
		}
		runtime.UnlockOSThread()
	}()
	return fn()
}

func run(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}
