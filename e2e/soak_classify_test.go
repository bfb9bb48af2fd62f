package e2e

import (
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

// TestSoakWindowOf checks which fault window a failure is charged to: an allowed one (SIGKILL,
// nat flush, descriptor exhaustion) wins over another it also overlaps, then the latest.
func TestSoakWindowOf(t *testing.T) {
	at := time.Date(2026, 11, 26, 15, 0, 0, 0, time.UTC)
	sec := func(n float64) time.Time { return at.Add(time.Duration(n * float64(time.Second))) }
	s := &soak{windows: []soakWindow{
		{"sigkill", sec(0), sec(0.2)},
		{"churn", sec(2), sec(2.1)},
		{"sigkill", sec(3), sec(3.3)},
		{"handover", sec(5), sec(6)},
		{"natflush", sec(8), sec(8.5)},
		{"fdexhaust", sec(10), sec(11.5)},
	}}
	for _, c := range []struct {
		start, end float64
		kind       string
		idx        int
	}{
		{0.1, 0.15, "sigkill", 0},
		{1.9, 3.1, "sigkill", 1}, // overlaps the churn and the second kill
		{2.05, 2.06, "churn", 0},
		{5.5, 8.2, "natflush", 0}, // a 5 s timeout from inside the hand-over into the flush
		{6.5, 7, "", -1},
		{9, 12, "fdexhaust", 0},
	} {
		kind, idx := s.windowOf(soakFailure{start: sec(c.start), end: sec(c.end)})
		if kind != c.kind || idx != c.idx {
			t.Errorf("failure %.2f-%.2fs: window %q %d, want %q %d", c.start, c.end, kind, idx, c.kind, c.idx)
		}
	}
}
