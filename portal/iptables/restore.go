package iptables

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal/kernel"
)

// maxIncrementalDeletes bounds the "-D CHAIN <rule>" lines one restore may use on a chain before
// the chain is rewritten whole instead. With iptables-nft a delete costs one read of the chain
// (shared by all deletes of a restore) plus a linear search per delete, while a rewrite costs a
// kernel add per rule: a handful of changes among thousands of rules is far cheaper as deletes
// and appends, a mass change is cheaper (and leaves the chain sorted) as a rewrite.
const maxIncrementalDeletes = 100

// jumpHead records which jump bodies are inserted at the head of their chain.
var jumpHead = func() map[string]bool {
	m := map[string]bool{}
	for _, j := range append(wantedJumps(true), kernelJumps()...) {
		m[j.body] = j.head
	}
	return m
}()

// plan is how one table goes from its believed-live state to the wanted one: up to two
// iptables-restore --noflush inputs, each one transaction.
//
// apply makes the wanted rules take effect: new and rewritten chains, jump changes, and the rules
// a small change adds, inserted at the head of their chain so that they win over any stale rule for
// the same portal. cleanup then deletes the stale rules one by one. The split is for speed: with
// iptables-nft a rule delete makes iptables-restore read and parse the whole chain (about 130 ms per
// 10,000-rule chain here) while a head insert costs almost nothing, so a changed service port is
// steered to its new proxy port within milliseconds and the cleanup follows in the same sync.
//
// The inputs are kept as lines to write, not as text: each is written out just before its
// restore and dropped after it (see input), so at most one is in memory at a time.
type plan struct {
	apply, cleanup input
	result         *tableState // the state after both
}

// restorePlan turns the believed-live state of one table into the wanted one (no input at all when
// nothing differs). With rewrite, every chain that differs is rewritten whole (used to repair, so a
// repaired chain is back in its canonical order); otherwise small differences become head inserts
// and deletes.
//
// There is never a moment with flushed chains: new or rewritten chains are declared (which creates
// or flushes them) and refilled in the same transaction, changed jumps are deleted and re-added,
// and chains no longer wanted are emptied and deleted last.
func restorePlan(table string, have, want *tableState, rewrite bool) plan {
	if have.equal(want) {
		return plan{result: have}
	}
	l := planLines{result: newTableState()}
	for _, c := range chainOrder(table, have, want) {
		l.chain(table, c, have, want, rewrite)
	}
	l.jumps(have, want)
	return plan{
		apply:   input{table: table, parts: [][]lines{l.decl, l.jumpDel, l.body, l.jumpAdd, l.drop}},
		cleanup: input{table: table, parts: [][]lines{l.kDecl, l.deletes, l.kDrop}},
		result:  l.result,
	}
}

// planLines are the lines of a plan, by the part of a transaction they go in, and the state
// after the plan.
type planLines struct {
	decl, jumpDel, body, jumpAdd, drop, deletes []lines
	// Kernel-path chains no longer wanted go in the cleanup transaction, after the deletes: a
	// rule of a chain changed by head insert and delete (KUBE-SERVICES) may still jump to them
	// until then, and they jump to each other, so all are flushed before any is removed.
	kDecl, kDrop []lines
	result       *tableState
}

// chain plans chain c: dropped, created, left alone, changed by head inserts and deletes, or
// rewritten whole.
func (l *planLines) chain(table, c string, have, want *tableState, rewrite bool) {
	w, wanted := want.chains[c]
	h, exists := have.chains[c]
	switch {
	case !wanted && exists && isKernelChain(table, c):
		l.kDecl = append(l.kDecl, line(":"+c+" - [0:0]"))
		l.kDrop = append(l.kDrop, line("-X "+c))
	case !wanted && exists:
		l.decl = append(l.decl, line(":"+c+" - [0:0]"))
		l.drop = append(l.drop, line("-X "+c))
	case !wanted:
	case !exists:
		l.rewrite(c, w)
	default:
		removed, added := multisetDiff(h, w)
		switch {
		case len(removed) == 0 && len(added) == 0:
			l.result.chains[c] = h
		case !rewrite && len(removed) <= maxIncrementalDeletes && !kernel.Ordered(table, c):
			// Inserted last first, so the added rules end up at the head in their own order.
			l.body = appendRules(l.body, "-I", c+" 1", reversed(added))
			l.deletes = appendRules(l.deletes, "-D", c, removed)
			l.result.chains[c] = append(slices.Clone(added), removeFirst(h, removed)...)
		default:
			l.rewrite(c, w)
		}
	}
}

// rewrite declares chain c (creating or flushing it) and fills it with rules.
func (l *planLines) rewrite(c string, rules []string) {
	l.decl = append(l.decl, line(":"+c+" - [0:0]"))
	l.body = appendRules(l.body, "-A", c, rules)
	l.result.chains[c] = rules
}

// jumps plans the jumps from the built-in chains: a chain whose jumps changed has them all
// deleted and added again, at the head or the tail as each wants.
func (l *planLines) jumps(have, want *tableState) {
	for _, chain := range sortedKeys(have.jumps, want.jumps) {
		h, w := have.jumps[chain], want.jumps[chain]
		if len(w) > 0 {
			l.result.jumps[chain] = w
		}
		if slices.Equal(h, w) {
			continue
		}
		l.jumpDel = appendRules(l.jumpDel, "-D", chain, h)
		var head, tail []string
		for _, j := range w {
			if jumpHead[j] {
				head = append(head, j)
			} else {
				tail = append(tail, j)
			}
		}
		l.jumpAdd = appendRules(l.jumpAdd, "-I", chain+" 1", reversed(head))
		l.jumpAdd = appendRules(l.jumpAdd, "-A", chain, tail)
	}
}

// lines are restore input lines that share a start: one line prefix+r for each r of rules, or
// the one line prefix when rules is nil. A plan refers to the rule bodies of the table states
// instead of building a string per line: at 10,000 service ports a first sync writes 30,000
// rules, and their lines were a second copy of every rule, alive while the input was built.
type lines struct {
	prefix string
	rules  []string
}

// line is a single input line.
func line(s string) lines { return lines{prefix: s} }

func (ls lines) size() int {
	if ls.rules == nil {
		return len(ls.prefix) + 1
	}
	n := 0
	for _, r := range ls.rules {
		n += len(ls.prefix) + len(r) + 1
	}
	return n
}

// appendRules adds the lines "op chain rule" for rules (none when there are none).
func appendRules(ls []lines, op, chain string, rules []string) []lines {
	if len(rules) == 0 {
		return ls
	}
	return append(ls, lines{prefix: op + " " + chain + " ", rules: rules})
}

func reversed(rules []string) []string {
	out := slices.Clone(rules)
	slices.Reverse(out)
	return out
}

// input is one iptables-restore transaction of a table: its parts' lines in order.
type input struct {
	table string
	parts [][]lines
}

const commitLine = "COMMIT\n"

// empty reports whether the transaction has no lines (a lines value always holds at least one).
func (in input) empty() bool {
	for _, part := range in.parts {
		if len(part) > 0 {
			return false
		}
	}
	return true
}

// size is the length of the transaction's text, 0 when it has no lines.
func (in input) size() int {
	n := 0
	for _, part := range in.parts {
		for _, ls := range part {
			n += ls.size()
		}
	}
	if n == 0 {
		return 0
	}
	return 1 + len(in.table) + 1 + n + len(commitLine)
}

// bytes is the transaction's text, or nil when it has no lines, in one buffer of its size: a
// growing buffer left the halves it outgrew for the collector.
func (in input) bytes() []byte {
	n := in.size()
	if n == 0 {
		return nil
	}
	r := newInputReader(in)
	buf := make([]byte, 0, n)
	for {
		buf = append(buf, r.buf...)
		if r.done {
			return buf
		}
		r.fill()
	}
}

// reader writes the transaction's text as it is read, a chunk at a time.
func (in input) reader() io.Reader { return newInputReader(in) }

func newInputReader(in input) *inputReader {
	return &inputReader{in: in, buf: append(make([]byte, 0, readChunk), "*"+in.table+"\n"...)}
}

// readChunk is how much text an inputReader writes ahead of its reader.
const readChunk = 32 << 10

// inputReader is the text of an input, written a chunk at a time; part, set and rule say where
// the next line is.
type inputReader struct {
	in              input
	part, set, rule int
	buf             []byte // written; buf[off:] is not read yet
	off             int
	done            bool // COMMIT is in buf
}

func (r *inputReader) Read(p []byte) (int, error) {
	for r.off == len(r.buf) {
		if r.done {
			return 0, io.EOF
		}
		r.fill()
	}
	n := copy(p, r.buf[r.off:])
	r.off += n
	return n, nil
}

// fill writes the next lines, about readChunk bytes of them, into buf (read to its end).
func (r *inputReader) fill() {
	buf := r.buf[:0]
	r.off = 0
	defer func() { r.buf = buf }()
	for r.part < len(r.in.parts) {
		if len(buf) >= readChunk {
			return
		}
		sets := r.in.parts[r.part]
		if r.set == len(sets) {
			r.part, r.set = r.part+1, 0
			continue
		}
		ls := sets[r.set]
		switch {
		case ls.rules == nil:
			buf = append(append(buf, ls.prefix...), '\n')
			r.set++
		case r.rule == len(ls.rules):
			r.set, r.rule = r.set+1, 0
		default:
			buf = append(append(append(buf, ls.prefix...), ls.rules[r.rule]...), '\n')
			r.rule++
		}
	}
	buf = append(buf, commitLine...)
	r.done = true
}

// multisetDiff returns the rules of have that want lacks and the rules of want that have lacks,
// each in its own order, counting duplicates.
func multisetDiff(have, want []string) (removed, added []string) {
	count := make(map[string]int, len(want))
	for _, r := range want {
		count[r]++
	}
	for _, r := range have {
		if count[r] > 0 {
			count[r]--
			continue
		}
		removed = append(removed, r)
	}
	count = make(map[string]int, len(have))
	for _, r := range have {
		count[r]++
	}
	for _, r := range want {
		if count[r] > 0 {
			count[r]--
			continue
		}
		added = append(added, r)
	}
	return removed, added
}

// removeFirst drops, for each rule of removed, its first occurrence in rules (what "-D" does).
func removeFirst(rules, removed []string) []string {
	drop := make(map[string]int, len(removed))
	for _, r := range removed {
		drop[r]++
	}
	out := make([]string, 0, len(rules))
	for _, r := range rules {
		if drop[r] > 0 {
			drop[r]--
			continue
		}
		out = append(out, r)
	}
	return out
}

func sortedKeys(ms ...map[string][]string) []string {
	var keys []string
	for _, m := range ms {
		for k := range m {
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	slices.Sort(keys)
	return keys
}

// parseSave reads our part of one table from iptables-save output: which of our chains exist and
// their rules, and the rules elsewhere that jump into them.
func parseSave(table string, data []byte) (*tableState, error) {
	st := newTableState()
	in := false
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "*"):
			in = line[1:] == table
		case !in || line == "COMMIT" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if isOwned(table, name) {
				st.chains[name] = []string{}
			}
		case strings.HasPrefix(line, "-A "):
			chain, body, _ := strings.Cut(line[3:], " ")
			if isOwned(table, chain) {
				st.chains[chain] = append(st.chains[chain], body)
			} else if ourJump(table, chain, body) {
				st.jumps[chain] = append(st.jumps[chain], body)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("parse iptables-save -t %s: %w", table, err)
	}
	return st, nil
}

// jumpTarget is the chain a rule body jumps to ("-j X" at the end), or "".
func jumpTarget(body string) string {
	i := strings.LastIndex(body, "-j ")
	if i < 0 || (i > 0 && body[i-1] != ' ') {
		return ""
	}
	target := body[i+3:]
	if strings.Contains(target, " ") {
		return ""
	}
	return target
}

// render prints a table state the way iptables-save prints it, limited to our chains and jumps.
func render(table string, st *tableState) string {
	var sb strings.Builder
	sb.WriteString("*" + table + "\n")
	order := chainOrder(table, st)
	for _, c := range order {
		if _, ok := st.chains[c]; ok {
			sb.WriteString(":" + c + " - [0:0]\n")
		}
	}
	for _, chain := range sortedKeys(st.jumps) {
		for _, j := range st.jumps[chain] {
			sb.WriteString("-A " + chain + " " + j + "\n")
		}
	}
	for _, c := range order {
		for _, r := range st.chains[c] {
			sb.WriteString("-A " + c + " " + r + "\n")
		}
	}
	sb.WriteString("COMMIT\n")
	return sb.String()
}
