package iptables

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// Fake is an in-memory Runner: iptables tables per family that understand the subset of
// iptables-restore / iptables-save / iptables used here, with iptables' exit codes (1 for a failed
// operation, 2 for a bad parameter). It lives in a non-test file so other packages' tests can use it.
type Fake struct {
	// RestoreHook, when set, runs before each restore; an error fails that restore unapplied.
	RestoreHook func(fam portal.Family, data []byte) error
	// NoNAT makes every restore that touches the nat table fail, as on a kernel without NAT.
	NoNAT bool
	// Unavailable marks families whose binaries are "not installed".
	Unavailable map[portal.Family]bool
	// Counters, keyed by "CHAIN rule-body", are the [packets, bytes] SaveCounters shows for a
	// rule (others show [0:0]). Set before use; read under the fake's lock.
	Counters map[string][2]uint64

	mu       sync.Mutex
	fams     map[portal.Family]map[string]*fakeTable
	restores int
	saves    int
	commands int
}

// FakeCounts counts the calls a Fake received.
type FakeCounts struct{ Restores, Saves, Commands int }

type fakeTable struct {
	chains map[string]*fakeChain
}

type fakeChain struct {
	builtin bool
	rules   []string
}

var builtinChains = map[string][]string{
	tableFilter: {"INPUT", "FORWARD", "OUTPUT"},
	tableNAT:    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
}

var fakeTargets = []string{"ACCEPT", "DROP", "RETURN", "REJECT", "REDIRECT", "DNAT", "SNAT", "MASQUERADE", "MARK", "LOG"}

// NewFake returns an empty fake: the filter and nat tables with their built-in chains, per family.
func NewFake() *Fake { return &Fake{} }

var _ Runner = (*Fake)(nil)

// Counts returns how many calls the fake has received.
func (f *Fake) Counts() FakeCounts {
	f.mu.Lock()
	defer f.mu.Unlock()
	return FakeCounts{Restores: f.restores, Saves: f.saves, Commands: f.commands}
}

func (f *Fake) family(fam portal.Family) map[string]*fakeTable {
	if f.fams == nil {
		f.fams = map[portal.Family]map[string]*fakeTable{}
	}
	ts, ok := f.fams[fam]
	if !ok {
		ts = map[string]*fakeTable{}
		for name, builtins := range builtinChains {
			t := &fakeTable{chains: map[string]*fakeChain{}}
			for _, c := range builtins {
				t.chains[c] = &fakeChain{builtin: true}
			}
			ts[name] = t
		}
		f.fams[fam] = ts
	}
	return ts
}

func (f *Fake) check(fam portal.Family, tool string) error {
	if f.Unavailable[fam] {
		return fmt.Errorf("fake %s%s: %w", fam, tool, ErrUnavailable)
	}
	return nil
}

// Restore implements Runner: each table section is one transaction, applied at COMMIT.
func (f *Fake) Restore(_ context.Context, fam portal.Family, data []byte) error {
	if err := f.check(fam, " restore"); err != nil {
		return err
	}
	if f.RestoreHook != nil {
		if err := f.RestoreHook(fam, data); err != nil {
			return err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.restores++
	ts := f.family(fam)
	var table string
	var work *fakeTable
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		fail := func(code int, msg string) error {
			return &ExitError{Command: "iptables-restore", Code: code, Stderr: fmt.Sprintf("line %d failed: %s", n, msg)}
		}
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			if f.NoNAT && table == tableNAT {
				return fail(1, "unable to initialize table 'nat'")
			}
			t, ok := ts[table]
			if !ok {
				return fail(1, "table '"+table+"' does not exist")
			}
			work = t.clone()
		case work == nil:
			return fail(2, "no table given")
		case line == "COMMIT":
			ts[table] = work
			work = nil
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if c, ok := work.chains[name]; ok {
				if !c.builtin {
					c.rules = nil // --noflush: declaring a user chain flushes it
				}
			} else {
				work.chains[name] = &fakeChain{}
			}
		default:
			op, rest, _ := strings.Cut(line, " ")
			if code, msg := work.apply(op, rest); code != 0 {
				return fail(code, msg)
			}
		}
	}
	if work != nil {
		return &ExitError{Command: "iptables-restore", Code: 1, Stderr: "no COMMIT line"}
	}
	return nil
}

// Save implements Runner.
func (f *Fake) Save(_ context.Context, fam portal.Family, table string) ([]byte, error) {
	if err := f.check(fam, " save"); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.saves++
	t, ok := f.family(fam)[table]
	if !ok {
		return nil, &ExitError{Command: "iptables-save", Code: 1, Stderr: "table '" + table + "' does not exist"}
	}
	return []byte(t.save(table)), nil
}

// SaveCounters implements CounterSaver: Save with every rule prefixed by its counters.
func (f *Fake) SaveCounters(ctx context.Context, fam portal.Family, table string) ([]byte, error) {
	data, err := f.Save(ctx, fam, table)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var sb strings.Builder
	for _, l := range strings.SplitAfter(string(data), "\n") {
		if rule, ok := strings.CutPrefix(l, "-A "); ok {
			c := f.Counters[strings.TrimSuffix(rule, "\n")]
			fmt.Fprintf(&sb, "[%d:%d] ", c[0], c[1])
		}
		sb.WriteString(l)
	}
	return []byte(sb.String()), nil
}

// Command implements Runner for -A, -I, -D, -C, -N, -F and -X (with -t TABLE, default filter).
func (f *Fake) Command(_ context.Context, fam portal.Family, args ...string) error {
	if err := f.check(fam, ""); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.commands++
	table := tableFilter
	var words []string
	for i := 0; i < len(args); i++ {
		switch args[i] {
		case "-t":
			if i+1 < len(args) {
				table = args[i+1]
				i++
			}
		case "-w", "--wait":
			if i+1 < len(args) && isNumber(args[i+1]) {
				i++
			}
		default:
			words = append(words, args[i])
		}
	}
	fail := func(code int, msg string) error {
		return &ExitError{Command: "iptables", Code: code, Stderr: msg}
	}
	if len(words) == 0 {
		return fail(2, "no command specified")
	}
	t, ok := f.family(fam)[table]
	if !ok {
		return fail(1, "table '"+table+"' does not exist")
	}
	if code, msg := t.apply(words[0], joinRule(words[1:])); code != 0 {
		return fail(code, msg)
	}
	return nil
}

// joinRule renders argv words the way iptables-save prints them: comments in double quotes.
func joinRule(words []string) string {
	out := make([]string, len(words))
	for i, w := range words {
		if i > 0 && words[i-1] == "--comment" {
			w = strconv.Quote(w)
		}
		out[i] = w
	}
	return strings.Join(out, " ")
}

func isNumber(s string) bool {
	_, err := strconv.Atoi(s)
	return err == nil
}

func (t *fakeTable) clone() *fakeTable {
	c := &fakeTable{chains: make(map[string]*fakeChain, len(t.chains))}
	for name, ch := range t.chains {
		c.chains[name] = &fakeChain{builtin: ch.builtin, rules: slices.Clone(ch.rules)}
	}
	return c
}

// apply runs one operation ("-A", ...) on "CHAIN rest" and returns iptables' exit code and message.
func (t *fakeTable) apply(op, rest string) (int, string) {
	chain, body, _ := strings.Cut(rest, " ")
	c, exists := t.chains[chain]
	switch op {
	case "-N":
		if exists {
			return 1, "Chain already exists"
		}
		t.chains[chain] = &fakeChain{}
		return 0, ""
	case "-F", "-X", "-A", "-I", "-D", "-C":
	default:
		return 2, "unknown option " + op
	}
	if !exists {
		return 1, "Couldn't load target `" + chain + "': No such file or directory"
	}
	switch op {
	case "-F":
		c.rules = nil
	case "-X":
		if c.builtin || len(c.rules) > 0 || t.referenced(chain) {
			return 1, "Directory not empty / chain in use: " + chain
		}
		delete(t.chains, chain)
	case "-A":
		if code, msg := t.checkTarget(body); code != 0 {
			return code, msg
		}
		c.rules = append(c.rules, body)
	case "-I":
		pos := 1
		if n, r, ok := strings.Cut(body, " "); ok && isNumber(n) {
			pos, _ = strconv.Atoi(n)
			body = r
		}
		if pos < 1 || pos > len(c.rules)+1 {
			return 1, "Index of insertion too big"
		}
		if code, msg := t.checkTarget(body); code != 0 {
			return code, msg
		}
		c.rules = slices.Insert(c.rules, pos-1, body)
	case "-D", "-C":
		i := slices.Index(c.rules, body)
		if op == "-D" && isNumber(body) {
			i, _ = strconv.Atoi(body)
			i--
		}
		if i < 0 || i >= len(c.rules) {
			return 1, "Bad rule (does a matching rule exist in that chain?)."
		}
		if op == "-D" {
			c.rules = slices.Delete(c.rules, i, i+1)
		}
	}
	return 0, ""
}

func (t *fakeTable) checkTarget(body string) (int, string) {
	target := jumpTarget(body)
	if target == "" {
		if i := strings.Index(body, "-j "); i >= 0 {
			target, _, _ = strings.Cut(body[i+3:], " ")
		}
	}
	if target == "" || slices.Contains(fakeTargets, target) {
		return 0, ""
	}
	if c, ok := t.chains[target]; ok && !c.builtin {
		return 0, ""
	}
	return 2, "Couldn't load target `" + target + "'"
}

func (t *fakeTable) referenced(chain string) bool {
	for _, c := range t.chains {
		for _, r := range c.rules {
			if jumpTarget(r) == chain {
				return true
			}
		}
	}
	return false
}

// chainOrder is built-in chains in kernel order, then user chains by name.
func (t *fakeTable) chainOrder(table string) []string {
	names := slices.Clone(builtinChains[table])
	user := slices.Sorted(maps.Keys(t.chains))
	for _, n := range user {
		if !t.chains[n].builtin {
			names = append(names, n)
		}
	}
	return names
}

func (t *fakeTable) save(table string) string {
	var sb strings.Builder
	sb.WriteString("*" + table + "\n")
	order := t.chainOrder(table)
	for _, n := range order {
		policy := "-"
		if t.chains[n].builtin {
			policy = "ACCEPT"
		}
		sb.WriteString(":" + n + " " + policy + " [0:0]\n")
	}
	for _, n := range order {
		for _, r := range t.chains[n].rules {
			sb.WriteString("-A " + n + " " + r + "\n")
		}
	}
	sb.WriteString("COMMIT\n")
	return sb.String()
}

func (t *fakeTable) empty() bool {
	for _, c := range t.chains {
		if !c.builtin || len(c.rules) > 0 {
			return false
		}
	}
	return true
}

// Dump prints every family that has rules or user chains, like iptables-save without counters:
// tables by name, built-in chains in kernel order, user chains by name, rules in chain order.
func (f *Fake) Dump() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var sb strings.Builder
	for _, fam := range portal.Families {
		ts, ok := f.fams[fam]
		if !ok {
			continue
		}
		names := slices.Sorted(maps.Keys(ts))
		if !slices.ContainsFunc(names, func(n string) bool { return !ts[n].empty() }) {
			continue
		}
		sb.WriteString("# " + fam.String() + "\n")
		for _, n := range names {
			sb.WriteString(ts[n].save(n))
		}
	}
	return sb.String()
}

// Chains implements Runner: the go-iptables calls Cleanup makes, on the same in-memory tables.
// Each call counts as a command.
func (f *Fake) Chains(_ context.Context, fam portal.Family) (Chains, error) {
	if err := f.check(fam, ""); err != nil {
		return nil, err
	}
	return &fakeChains{f: f, fam: fam}, nil
}

type fakeChains struct {
	f   *Fake
	fam portal.Family
}

// table returns the table, counting the call; the caller holds f.mu.
func (c *fakeChains) table(name string) (*fakeTable, error) {
	c.f.commands++
	t, ok := c.f.family(c.fam)[name]
	if !ok {
		return nil, &ExitError{Command: "iptables", Code: 1, Stderr: "table '" + name + "' does not exist"}
	}
	return t, nil
}

func (c *fakeChains) ListChains(table string) ([]string, error) {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	t, err := c.table(table)
	if err != nil {
		return nil, err
	}
	return t.chainOrder(table), nil
}

func (c *fakeChains) List(table, chain string) ([]string, error) {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	t, err := c.table(table)
	if err != nil {
		return nil, err
	}
	ch, ok := t.chains[chain]
	if !ok {
		return nil, &ExitError{Command: "iptables", Code: 1, Stderr: "No chain/target/match by that name."}
	}
	out := []string{"-N " + chain}
	if ch.builtin {
		out[0] = "-P " + chain + " ACCEPT"
	}
	for _, r := range ch.rules {
		out = append(out, "-A "+chain+" "+r)
	}
	return out, nil
}

func (c *fakeChains) op(table, op, chain string, rulespec ...string) error {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	t, err := c.table(table)
	if err != nil {
		return err
	}
	if code, msg := t.apply(op, strings.TrimSpace(chain+" "+joinRule(rulespec))); code != 0 {
		return &ExitError{Command: "iptables", Code: code, Stderr: msg}
	}
	return nil
}

func (c *fakeChains) Delete(table, chain string, rulespec ...string) error {
	return c.op(table, "-D", chain, rulespec...)
}

func (c *fakeChains) ClearChain(table, chain string) error { return c.op(table, "-F", chain) }

func (c *fakeChains) DeleteChain(table, chain string) error { return c.op(table, "-X", chain) }
