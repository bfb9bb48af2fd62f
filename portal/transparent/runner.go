package transparent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// Runner is the seam over the nft binary. A Runner that also has iptables' Save and Restore
// (ExecRunner does) lets Cleanup remove an earlier build's iptables chain.
type Runner interface {
	// NFT runs `nft args...` with stdin (when not nil) and returns its stdout. A missing binary is
	// an error wrapping iptables.ErrUnavailable; a failed run an *iptables.ExitError.
	NFT(ctx context.Context, stdin []byte, args ...string) ([]byte, error)
}

// ExecRunner runs nft, and iptables (through iptables.ExecRunner, for Cleanup only); its Prefix
// applies to nft too.
type ExecRunner struct {
	iptables.ExecRunner
}

var _ Runner = (*ExecRunner)(nil)

// NFT implements Runner.
func (r *ExecRunner) NFT(ctx context.Context, stdin []byte, args ...string) ([]byte, error) {
	if _, err := exec.LookPath("nft"); err != nil {
		return nil, fmt.Errorf("nft: %w (%w)", iptables.ErrUnavailable, err)
	}
	argv := append(append(append([]string{}, r.Prefix...), "nft"), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ee, ok := errors.AsType[*exec.ExitError](err); ok {
		return nil, &iptables.ExitError{Command: "nft", Code: ee.ExitCode(), Stderr: stderr.String()}
	}
	if err != nil {
		return nil, fmt.Errorf("nft: %w", err)
	}
	return stdout.Bytes(), nil
}

// reasonFor is the Support.Reason of a failure: the missing privilege or binary when the error
// says so, otherwise def (what the failed part needs of the kernel).
func reasonFor(err error, def string) string {
	msg := err.Error()
	switch {
	case errors.Is(err, unix.EPERM), strings.Contains(msg, "Permission denied"), strings.Contains(msg, "Operation not permitted"):
		return "no CAP_NET_ADMIN"
	case errors.Is(err, iptables.ErrUnavailable) && strings.Contains(msg, "nft"):
		return "no nft"
	case errors.Is(err, iptables.ErrUnavailable):
		return "no iptables"
	}
	return def
}
