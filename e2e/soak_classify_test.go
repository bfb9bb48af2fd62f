package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestSoakMoveCause checks the soak's explanation of a ClientIP client's move to another pod. The
// case CI met (b104a79): an endpoint change that the proxy applied only seconds after the API
// accepted it (its informers were backing off after an API server restart) moved the client more
// than 2 s after the write; counting from the write called it a switch. The fault now lasts until
// the proxy uses the endpoints written, and a move is explained by the pod it left being out of
// the ready set, or by a new process.
func TestSoakMoveCause(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		name    string
		active  string
		movedBy string
		movedAt time.Duration // before now
		ready   []string
		from    string
		want    string
	}{
		{"churn still being applied, the pod left", "churn", "sigkill", time.Minute, []string{"pod3"}, "pod2", "pod left the ready set (churn)"},
		{"churn applied 1s ago, the pod left", "", "churn", time.Second, []string{"pod3"}, "pod2", "pod left the ready set (churn)"},
		{"terminating applied, the pod is terminating", "", "terminating", time.Second, []string{"pod1"}, "pod2", "pod left the ready set (terminating)"},
		{"churn, the pod stayed ready", "churn", "", 0, []string{"pod2", "pod3"}, "pod2", ""},
		{"a new process after SIGKILL", "sigkill", "", 0, []string{"pod2"}, "pod2", "new process (sigkill)"},
		{"1s after a hand-over", "", "handover", time.Second, []string{"pod2"}, "pod2", "new process (handover)"},
		{"3s after a hand-over", "", "handover", 3 * time.Second, []string{"pod2"}, "pod2", ""},
		{"during an API server restart", "apiserver", "churn", time.Minute, []string{"pod2"}, "pod2", ""},
		{"a dial without a descriptor", "fdexhaust", "", 0, []string{"pod2"}, "pod2", "dial without a descriptor re-picked (fdexhaust)"},
		{"no fault", "", "", 0, []string{"pod1", "pod2", "pod3"}, "pod1", ""},
	} {
		s := &soak{active: c.active, movedBy: c.movedBy, stickyIn: map[string]bool{}}
		if c.movedBy != "" {
			s.moved = now.Add(-c.movedAt)
		}
		for _, p := range c.ready {
			s.stickyIn[p] = true
		}
		if got := s.moveCause(c.from, now); got != c.want {
			t.Errorf("%s: moveCause(%s) = %q, want %q", c.name, c.from, got, c.want)
		}
	}
	// Seen in a 30-minute run: a request made during a descriptor exhaustion is answered after
	// the limit came back, by another pod (its dial backed off past its timeout and re-picked).
	s := &soak{stickyIn: map[string]bool{"pod2": true, "pod3": true}, movedBy: "terminating", moved: now.Add(-3 * time.Second),
		windows: []soakWindow{{"terminating", now.Add(-3 * time.Second), now.Add(-3 * time.Second)}, {"fdexhaust", now.Add(-1900 * time.Millisecond), now.Add(-200 * time.Millisecond)}}}
	if got, want := s.moveCause("pod2", now.Add(-time.Second)), "dial without a descriptor re-picked (fdexhaust)"; got != want {
		t.Errorf("a request made during fdexhaust, answered after it: moveCause = %q, want %q", got, want)
	}
	if got := s.moveCause("pod2", now.Add(-100*time.Millisecond)); got != "" {
		t.Errorf("a request made after fdexhaust: moveCause = %q, want a switch", got)
	}
}

// TestSoakRule checks the soak's rule (classifySoak) on failures placed against fault windows.
// The cases marked "lax" passed under the rule before issue 34, which excused every failure in
// flight during a SIGKILL, nat-flush or descriptor-exhaustion window without a count, let that
// window win over any other the failure overlapped, and only logged lost UDP answers.
func TestSoakRule(t *testing.T) {
	at := time.Date(2026, 11, 26, 15, 0, 0, 0, time.UTC)
	sec := func(n float64) time.Time { return at.Add(time.Duration(n * float64(time.Second))) }
	windows := []soakWindow{
		{"sigkill", sec(0), sec(2)},      // a slow restart: the window outlasts soakKillWindow
		{"natflush", sec(4), sec(5)},     // 15:00:04
		{"handover", sec(10), sec(10.5)}, // 15:00:10
		{"fdexhaust", sec(20), sec(21.6)},
		{"datapath", sec(30), sec(30.4)},
		{"sigkill", sec(40), sec(40.3)},
		{"churn", sec(43), sec(43.1)},
		{"natflush", sec(50), sec(50.5)},
	}
	fail := func(target string, start, end float64) soakFailure {
		return soakFailure{target: target, start: sec(start), end: sec(end)}
	}
	lost := func(start float64) soakFailure {
		return soakFailure{target: "web cluster IP udp", start: sec(start), end: sec(start + 1), lost: true}
	}
	many := func(n int, start float64) []soakFailure {
		var out []soakFailure
		for i := range n {
			out = append(out, fail("web node port", start+float64(i)*0.01, start+float64(i)*0.01+0.005))
		}
		return out
	}
	for _, c := range []struct {
		name     string
		windows  []soakWindow // nil: windows
		failures []soakFailure
		want     []string // a substring of each breach, in order
	}{
		{name: "nothing failed"},
		{name: "refused right after a kill", failures: []soakFailure{fail("web cluster IP", 0.1, 0.1), fail("keep-alive stream", 0.9, 1.2), lost(0.5)}},
		{name: "a nat flush within its bound", failures: append(many(soakNatFlushMaxFailures, 4.2), lost(4.1), lost(4.4), lost(4.9))},
		{name: "a descriptor exhaustion within its bound", failures: append(many(soakFDExhaustMaxFailures, 20.2), lost(21), lost(21.5))},
		{name: "an endpoint change closing a UDP session in flight", failures: []soakFailure{lost(43)}},
		{name: "an endpoint change losing two answers", failures: []soakFailure{lost(42.5), lost(43)},
			want: []string{"churn 1 at 15:00:43.000: 0 failures and 2 lost answers in flight during it, bound 0 and 1 more lost answers"}},
		{name: "a timeout begun in the flush, ending after it", failures: []soakFailure{fail("web node port", 4.5, 9.5)}},
		{name: "a kill's window outlasting soakKillWindow", failures: []soakFailure{fail("web cluster IP", 1.5, 1.5)},
			want: []string{"sigkill 1 at 15:00:00.000: 1 attempts begun 1s or more after it failed (the last +1.5s)"}},
		{name: "lax: begun after the kill's excuse, ending in a flush", failures: []soakFailure{fail("web node port", 1.5, 6.5)},
			want: []string{"sigkill 1 at 15:00:00.000: 1 attempts begun 1s or more"}},
		{name: "lax: excused by the kill, yet in flight during a churn", failures: []soakFailure{fail("sticky cluster IP", 40.1, 45.1)},
			want: []string{"churn 1 at 15:00:43.000: 1 failures and 0 lost answers in flight during it, bound 0 and 1 more"}},
		{name: "lax: excused by the flush, yet in flight during a hand-over", failures: []soakFailure{fail("web node port", 4.8, 10.2)},
			want: []string{"handover 1 at 15:00:10.000: 1 failures and 0 lost answers in flight during it, bound 0 and 0 more"}},
		{name: "lax: more nat-flush failures than its bound", failures: many(soakNatFlushMaxFailures+1, 4.1),
			want: []string{fmt.Sprintf("natflush 1 at 15:00:04.000: %d failures and 0 lost answers in flight during it, bound %d and %d more lost answers",
				soakNatFlushMaxFailures+1, soakNatFlushMaxFailures, soakNatFlushMaxLost)}},
		{name: "lax: lost answers count against the flush's bound", failures: append(many(soakNatFlushMaxFailures, 50.1), lost(49.8), lost(50.2), lost(50.3), lost(50.4)),
			want: []string{"natflush 2 at 15:00:50.000: 4 failures and 4 lost answers"}},
		{name: "lax: more descriptor-exhaustion failures than its bound", failures: many(soakFDExhaustMaxFailures+1, 20.1),
			want: []string{"fdexhaust 1 at 15:00:20.000: 5 failures"}},
		{name: "lax: a UDP answer lost with no fault near", failures: []soakFailure{lost(60)},
			want: []string{"1 failures and lost answers in flight during no fault, bound 0"}},
		{name: "lax: a UDP answer lost a second after a flush", failures: []soakFailure{lost(6)},
			want: []string{"1 failures and lost answers in flight during no fault"}},
		{name: "a failure across a data path switch", failures: []soakFailure{fail("keep-alive stream", 30.2, 30.2)},
			want: []string{"datapath 1 at 15:00:30.000: 1 failures and 0 lost answers in flight during it, bound 0 and 0 more"}},
		{name: "a UDP answer lost across a data path switch", failures: []soakFailure{lost(30.3)},
			want: []string{"datapath 1 at 15:00:30.000: 0 failures and 1 lost answers"}},
		{name: "a failure between faults", failures: []soakFailure{fail("web cluster IP", 25, 25)},
			want: []string{"1 failures and lost answers in flight during no fault"}},
		{name: "lax: a nat flush's window past its bound", windows: []soakWindow{{"natflush", sec(0), sec(6.6)}},
			want: []string{"natflush 1 at 15:00:00.000 lasted 6.6s, bound 3s"}},
		{name: "lax: a descriptor exhaustion's window past its bound", windows: []soakWindow{{"fdexhaust", sec(0), sec(3.1)}},
			want: []string{"fdexhaust 1 at 15:00:00.000 lasted 3.1s, bound 3s"}},
		{name: "a hand-over within its bound", windows: []soakWindow{{"handover", sec(0), sec(3)}}},
		{name: "one failure counts against both flushes it overlaps",
			windows:  []soakWindow{{"natflush", sec(0), sec(1)}, {"natflush", sec(2), sec(3)}},
			failures: append(append(many(soakNatFlushMaxFailures-1, 0.1), fail("web cluster IP", 0.9, 2.1)), many(soakNatFlushMaxFailures-1, 2.2)...),
			want:     nil}, // each at its bound: the shared one counted in both
		{name: "one failure over the bound of both flushes it overlaps",
			windows:  []soakWindow{{"natflush", sec(0), sec(1)}, {"natflush", sec(2), sec(3)}},
			failures: append(append(many(soakNatFlushMaxFailures, 0.1), fail("web cluster IP", 0.9, 2.1)), many(soakNatFlushMaxFailures, 2.2)...),
			want:     []string{"natflush 1 at 15:00:00.000: 5 failures", "natflush 2 at 15:00:02.000: 5 failures"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ws := c.windows
			if ws == nil {
				ws = windows
			}
			got := classifySoak(ws, c.failures).breaches
			ok := len(got) == len(c.want)
			for i := 0; ok && i < len(got); i++ {
				ok = strings.Contains(got[i], c.want[i])
			}
			if !ok {
				t.Errorf("breaches:\n%s\nwant (substrings):\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
			}
		})
	}
}

// TestSoakRuleCharges checks where classifySoak puts each failure: a kill's excused and late
// ones apart, a failure overlapping two windows in both, one overlapping none outside.
func TestSoakRuleCharges(t *testing.T) {
	at := time.Date(2026, 11, 26, 15, 0, 0, 0, time.UTC)
	sec := func(n float64) time.Time { return at.Add(time.Duration(n * float64(time.Second))) }
	f := func(start, end float64) soakFailure {
		return soakFailure{target: "x", start: sec(start), end: sec(end)}
	}
	v := classifySoak([]soakWindow{{"sigkill", sec(0), sec(2)}, {"natflush", sec(3), sec(4)}},
		[]soakFailure{f(0.5, 0.5), f(1.5, 3.5), f(0.9, 3.2), f(5, 5)})
	type counts struct{ charged, excused, late int }
	var got []counts
	for _, c := range v.charges {
		got = append(got, counts{len(c.charged), len(c.excused), len(c.late)})
	}
	want := []counts{{0, 2, 1}, {2, 0, 0}}
	if !slices.Equal(got, want) || len(v.outside) != 1 {
		t.Errorf("charges %+v, %d outside; want %+v, 1 outside", got, len(v.outside), want)
	}
}
