package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

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

// Restore implements Runner.
func (r *ExecRunner) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	_, err := r.run(ctx, data, r.binary(fam, "restore"), "-w", r.wait(), "--noflush")
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

func (r *ExecRunner) run(ctx context.Context, stdin []byte, bin string, args ...string) ([]byte, error) {
	if _, err := exec.LookPath(bin); err != nil {
		return nil, fmt.Errorf("%s: %w (%w)", bin, ErrUnavailable, err)
	}
	argv := append(append(append([]string{}, r.Prefix...), bin), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
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
