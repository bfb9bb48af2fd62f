package transparent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// LegacyChain is the iptables mangle chain, in both families, that an earlier build marked the
// replies with (jumped to from mangle PREROUTING). Nothing installs it now; Cleanup removes it.
const LegacyChain = "KUBE-PORTALS-TRANSPARENT"

// legacyRunner is what Cleanup needs of iptables to remove LegacyChain: a Runner that has it
// (ExecRunner does) gets it removed, others skip it.
type legacyRunner interface {
	Save(ctx context.Context, fam portal.Family, table string) ([]byte, error)
	Restore(ctx context.Context, fam portal.Family, data []byte) error
}

// cleanupLegacy removes LegacyChain and every rule that jumps to it from fam's mangle table, in
// one transaction. A node without iptables cannot have it.
func (n *Node) cleanupLegacy(ctx context.Context, fam portal.Family) error {
	ipt, ok := n.cfg.Runner.(legacyRunner)
	if !ok {
		return nil
	}
	data, err := ipt.Save(ctx, fam, "mangle")
	if errors.Is(err, iptables.ErrUnavailable) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("iptables-save -t mangle: %w", err)
	}
	exists, jumps := false, []string(nil)
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == ":"+LegacyChain || strings.HasPrefix(line, ":"+LegacyChain+" "):
			exists = true
		case strings.HasPrefix(line, "-A ") && !strings.HasPrefix(line, "-A "+LegacyChain+" ") &&
			(strings.HasSuffix(line, " -j "+LegacyChain) || strings.Contains(line, " -j "+LegacyChain+" ")):
			jumps = append(jumps, "-D "+strings.TrimPrefix(line, "-A "))
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("parse iptables-save -t mangle: %w", err)
	}
	if !exists && len(jumps) == 0 {
		return nil
	}
	lines := append([]string{"*mangle"}, jumps...)
	if exists {
		// Declaring the chain flushes it, so it can be deleted.
		lines = append(lines, ":"+LegacyChain+" - [0:0]", "-X "+LegacyChain)
	}
	lines = append(lines, "COMMIT", "")
	if err := ipt.Restore(ctx, fam, []byte(strings.Join(lines, "\n"))); err != nil {
		return fmt.Errorf("iptables-restore: %w", err)
	}
	return nil
}
