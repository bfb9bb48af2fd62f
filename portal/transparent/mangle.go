package transparent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
)

// The mangle table is not one portal/iptables writes (it owns nat and filter only), and its
// iptables-restore runs with --noflush naming only its own tables, so the two never touch each
// other's chains.
const tableMangle = "mangle"

// markRule marks the replies to a transparent socket: conntrack's reply direction first, so the
// socket lookup runs only for replies (what the proxy's dials get back), never for the first
// packet of a connection; --nowildcard leaves out listeners on wildcard addresses (the proxy's
// own listening sockets are not transparent anyway), so only the connected sockets count.
func (n *Node) markRule() string {
	return fmt.Sprintf("-m conntrack --ctdir REPLY -m socket --transparent --nowildcard -j MARK --set-xmark %#x/%#x", n.cfg.Mark, n.cfg.Mark)
}

// jumpRule is the jump from mangle PREROUTING, as iptables-save prints it (after "-A PREROUTING").
const jumpRule = "-j " + Chain

// mangleState is our part of one family's mangle table: whether the chain exists, its rules, and
// every rule of another chain that jumps to it ("CHAIN body").
type mangleState struct {
	exists bool
	rules  []string
	jumps  []string
}

func (s mangleState) equal(o mangleState) bool {
	return s.exists == o.exists && slices.Equal(s.rules, o.rules) && slices.Equal(s.jumps, o.jumps)
}

// parseMangle reads our part from iptables-save -t mangle.
func parseMangle(data []byte) (mangleState, error) {
	var st mangleState
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == ":"+Chain || strings.HasPrefix(line, ":"+Chain+" "):
			st.exists = true
		case strings.HasPrefix(line, "-A "+Chain+" "):
			st.rules = append(st.rules, strings.TrimPrefix(line, "-A "+Chain+" "))
		case strings.HasPrefix(line, "-A ") && (strings.HasSuffix(line, " -j "+Chain) || strings.Contains(line, " -j "+Chain+" ")):
			st.jumps = append(st.jumps, strings.TrimPrefix(line, "-A "))
		}
	}
	if err := sc.Err(); err != nil {
		return mangleState{}, fmt.Errorf("parse iptables-save -t mangle: %w", err)
	}
	return st, nil
}

func (n *Node) wantMangle() mangleState {
	return mangleState{exists: true, rules: []string{n.markRule()}, jumps: []string{"PREROUTING " + jumpRule}}
}

func (n *Node) readMangle(ctx context.Context, fam portal.Family) (mangleState, error) {
	data, err := n.cfg.Runner.Save(ctx, fam, tableMangle)
	if err != nil {
		return mangleState{}, fmt.Errorf("iptables-save: %w", err)
	}
	return parseMangle(data)
}

// syncMangle rewrites chain and jump in one transaction unless they are as we want them or as we
// last read them back after writing.
func (n *Node) syncMangle(ctx context.Context, fam portal.Family) error {
	have, err := n.readMangle(ctx, fam)
	if err != nil {
		return err
	}
	if last, ok := n.mangle[fam]; have.equal(n.wantMangle()) || ok && have.equal(last) {
		return nil
	}
	// Declaring the chain creates or flushes it; the old jumps go and the new one is inserted
	// at the head, so a rule before it that accepts cannot hide replies from the mark.
	lines := []string{"*" + tableMangle, ":" + Chain + " - [0:0]"}
	for _, j := range have.jumps {
		lines = append(lines, "-D "+j)
	}
	lines = append(lines, "-I PREROUTING 1 "+jumpRule, "-A "+Chain+" "+n.markRule(), "COMMIT", "")
	if err := n.cfg.Runner.Restore(ctx, fam, []byte(strings.Join(lines, "\n"))); err != nil {
		delete(n.mangle, fam)
		return fmt.Errorf("iptables-restore: %w", err)
	}
	after, err := n.readMangle(ctx, fam)
	if err != nil {
		return err
	}
	n.mangle[fam] = after
	return nil
}

// cleanupMangle removes the jumps and the chain in one transaction; a family without iptables is
// skipped.
func (n *Node) cleanupMangle(ctx context.Context, fam portal.Family) error {
	have, err := n.readMangle(ctx, fam)
	if errors.Is(err, iptables.ErrUnavailable) {
		return nil
	}
	if err != nil {
		return err
	}
	if !have.exists && len(have.jumps) == 0 {
		return nil
	}
	lines := []string{"*" + tableMangle}
	for _, j := range have.jumps {
		lines = append(lines, "-D "+j)
	}
	if have.exists {
		lines = append(lines, ":"+Chain+" - [0:0]", "-X "+Chain)
	}
	lines = append(lines, "COMMIT", "")
	if err := n.cfg.Runner.Restore(ctx, fam, []byte(strings.Join(lines, "\n"))); err != nil {
		return fmt.Errorf("iptables-restore: %w", err)
	}
	return nil
}
