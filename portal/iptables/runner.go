package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"

	goiptables "github.com/coreos/go-iptables/iptables"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Runner is the narrow seam over the iptables binaries. ExecRunner runs them; Fake keeps tables in
// memory so the real rule-building code runs in tests.
type Runner interface {
	// Restore feeds data to `iptables-restore --noflush` (ip6tables-restore for IPv6): one
	// transaction that applies entirely or not at all.
	Restore(ctx context.Context, fam portal.Family, data []byte) error
	// Save returns `iptables-save -t table`.
	Save(ctx context.Context, fam portal.Family, table string) ([]byte, error)
	// Command runs one `iptables` command (args follow the binary name, e.g. "-t", "nat", "-A", ...).
	Command(ctx context.Context, fam portal.Family, args ...string) error
	// Chains returns the one-command-at-a-time API of fam's iptables that Cleanup uses; an error
	// wrapping ErrUnavailable when its binary is not installed.
	Chains(ctx context.Context, fam portal.Family) (Chains, error)
}

// Chains is the part of github.com/coreos/go-iptables that Cleanup needs: list chains and rules,
// delete a rule, flush and delete a chain. *goiptables.IPTables implements it; Fake does in memory.
type Chains interface {
	// ListChains lists the table's chains, built-in ones first.
	ListChains(table string) ([]string, error)
	// List prints a chain as `iptables -S` does: "-N CHAIN" or "-P CHAIN POLICY", then "-A CHAIN ..." lines.
	List(table, chain string) ([]string, error)
	Delete(table, chain string, rulespec ...string) error
	ClearChain(table, chain string) error
	DeleteChain(table, chain string) error
}

// ErrUnavailable means the iptables binary of a family is not installed; the family is skipped.
var ErrUnavailable = errors.New("iptables binary not available")

// ExitError is a failed iptables command: its exit code (1 for a failed operation, 2 for a bad
// parameter, 4 for a resource problem such as the xtables lock) and what it said on stderr.
type ExitError struct {
	Command string
	Code    int
	Stderr  string
}

func (e *ExitError) Error() string {
	return fmt.Sprintf("%s: exit status %d: %s", e.Command, e.Code, strings.TrimSpace(e.Stderr))
}

// ExecRunner runs the iptables binaries of the node.
type ExecRunner struct {
	// Prefix runs every command under another one, e.g. {"ip", "netns", "exec", "NS"} in tests.
	Prefix []string
	// Variant selects the binaries: "" for the system's iptables, or "nft" / "legacy" for
	// iptables-nft* / iptables-legacy*.
	Variant string
	// WaitSeconds is passed as -w to wait for the xtables lock; 0 means 5.
	WaitSeconds int
	// Do, when set, runs each go-iptables call (Chains), e.g. on a thread switched into another
	// network namespace: go-iptables runs the binary itself and knows nothing of Prefix. Tests
	// that set Prefix set Do to the same namespace's NS.Do.
	Do func(func() error) error
}

var _ Runner = (*ExecRunner)(nil)

func (r *ExecRunner) binary(fam portal.Family, tool string) string {
	name := "iptables"
	if fam == portal.IPv6 {
		name = "ip6tables"
	}
	if r.Variant != "" {
		name += "-" + r.Variant
	}
	if tool != "" {
		name += "-" + tool
	}
	return name
}

func (r *ExecRunner) wait() string {
	if r.WaitSeconds <= 0 {
		return "5"
	}
	return fmt.Sprint(r.WaitSeconds)
}

// streamRestorer is a Runner that feeds iptables-restore from a reader as the command consumes
// it: a sync's input is then never whole in memory (at 10,000 service ports the nat table's is
// 3 MB, alive at the sync's peak). Portals uses it when the runner has it.
type streamRestorer interface {
	RestoreFrom(ctx context.Context, fam portal.Family, input io.Reader) error
}

var _ streamRestorer = (*ExecRunner)(nil)

// Restore implements Runner.
func (r *ExecRunner) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	return r.RestoreFrom(ctx, fam, bytes.NewReader(data))
}

// RestoreFrom is Restore with the input read from input while the command runs.
func (r *ExecRunner) RestoreFrom(ctx context.Context, fam portal.Family, input io.Reader) error {
	_, err := r.run(ctx, input, r.binary(fam, "restore"), "-w", r.wait(), "--noflush")
	return err
}

// Save implements Runner.
func (r *ExecRunner) Save(ctx context.Context, fam portal.Family, table string) ([]byte, error) {
	return r.run(ctx, nil, r.binary(fam, "save"), "-t", table)
}

// Command implements Runner.
func (r *ExecRunner) Command(ctx context.Context, fam portal.Family, args ...string) error {
	_, err := r.run(ctx, nil, r.binary(fam, ""), append([]string{"-w", r.wait()}, args...)...)
	return err
}

// Chains implements Runner with github.com/coreos/go-iptables, which finds the binary, reads its
// version and adds --wait as the binary supports it.
func (r *ExecRunner) Chains(ctx context.Context, fam portal.Family) (Chains, error) {
	bin := r.binary(fam, "")
	if _, err := exec.LookPath(bin); err != nil {
		return nil, fmt.Errorf("%s: %w (%w)", bin, ErrUnavailable, err)
	}
	if len(r.Prefix) > 0 && r.Do == nil {
		return nil, fmt.Errorf("%s: a command prefix needs Do for go-iptables", bin)
	}
	c := &goChains{do: r.Do}
	proto := goiptables.ProtocolIPv4
	if fam == portal.IPv6 {
		proto = goiptables.ProtocolIPv6
	}
	wait, _ := strconv.Atoi(r.wait())
	err := c.run(ctx, func() (err error) {
		c.ipt, err = goiptables.New(goiptables.IPFamily(proto), goiptables.Path(bin), goiptables.Timeout(wait))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bin, err)
	}
	c.ctx = ctx
	return c, nil
}

// goChains runs go-iptables calls, each under do when set. go-iptables takes no context: ctx is
// checked before each call.
type goChains struct {
	ipt *goiptables.IPTables
	do  func(func() error) error
	ctx context.Context
}

func (c *goChains) run(ctx context.Context, fn func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if c.do != nil {
		return c.do(fn)
	}
	return fn()
}

func (c *goChains) ListChains(table string) (out []string, err error) {
	err = c.run(c.ctx, func() error { out, err = c.ipt.ListChains(table); return err })
	return out, err
}

func (c *goChains) List(table, chain string) (out []string, err error) {
	err = c.run(c.ctx, func() error { out, err = c.ipt.List(table, chain); return err })
	return out, err
}

func (c *goChains) Delete(table, chain string, rulespec ...string) error {
	return c.run(c.ctx, func() error { return c.ipt.Delete(table, chain, rulespec...) })
}

func (c *goChains) ClearChain(table, chain string) error {
	return c.run(c.ctx, func() error { return c.ipt.ClearChain(table, chain) })
}

func (c *goChains) DeleteChain(table, chain string) error {
	return c.run(c.ctx, func() error { return c.ipt.DeleteChain(table, chain) })
}

func (r *ExecRunner) run(ctx context.Context, stdin io.Reader, bin string, args ...string) ([]byte, error) {
	if _, err := exec.LookPath(bin); err != nil {
		return nil, fmt.Errorf("%s: %w (%w)", bin, ErrUnavailable, err)
	}
	argv := append(append(append([]string{}, r.Prefix...), bin), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	if stdin != nil {
		cmd.Stdin = stdin
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return nil, &ExitError{Command: bin, Code: ee.ExitCode(), Stderr: stderr.String()}
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", bin, err)
	}
	return stdout.Bytes(), nil
}
