package iptables

import (
	"context"
	"errors"
	"fmt"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// CheckNAT tells whether the iptables portals can work on this node for fam: it adds a REDIRECT
// and a DNAT rule to a scratch nat chain and removes them again, in one iptables-restore
// transaction that leaves nothing behind. nil means NAT works. An error wrapping
// ErrNATUnavailable means it does not (the restore failed, or there is no iptables binary at
// all): the bind mode is the answer. Any other error (a cancelled ctx) says nothing either way.
// Call it at start-up in iptables mode, e.g. CheckNAT(ctx, &ExecRunner{}, IPv4).
func CheckNAT(ctx context.Context, runner Runner, fam portal.Family) error {
	dst := "127.0.0.1:1"
	if fam == portal.IPv6 {
		dst = "[::1]:1"
	}
	err := runner.Restore(ctx, fam, fmt.Appendf(nil, natProbe, dst))
	var exit *ExitError
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("portal %s: NAT probe: %w", fam, ctx.Err())
	case errors.As(err, &exit), errors.Is(err, ErrUnavailable):
		return fmt.Errorf("portal %s: NAT probe: %w: %w", fam, ErrNATUnavailable, err)
	default:
		return fmt.Errorf("portal %s: NAT probe: %w", fam, err)
	}
}
