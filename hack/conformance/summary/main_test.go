package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// TestSummaryTableFromJUnit: a ginkgo JUnit report becomes the summary: suite entries and specs
// outside the focus left out, failures first with their first line, skipped specs with the
// skips.txt reason or their own skip message.
func TestSummaryTableFromJUnit(t *testing.T) {
	rules, err := readSkips("testdata/skips.txt")
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open("testdata/junit.xml")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	results, err := summarize(f, rules, regexp.MustCompile(`\[sig-network\] Services `))
	if err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	if err := write(&got, results); err != nil {
		t.Fatal(err)
	}
	golden := filepath.Join("testdata", "summary.golden.md")
	if *update {
		if err := os.WriteFile(golden, got.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got.String() != string(want) {
		t.Errorf("summary differs from %s (go test -update to accept):\n%s", golden, got.String())
	}
}

func TestSkipReason(t *testing.T) {
	rules := []skipRule{{re: regexp.MustCompile(`\[Disruptive\]`), reason: "restarts components"}}
	for _, tc := range []struct {
		name, spec string
		msg        *message
		want       string
	}{
		{"a skips.txt rule names the reason", "x [Disruptive]", &message{Message: "skipped"}, "restarts components"},
		{"the spec's own Skipf message", "x", &message{Message: "skipped - Requires at least 2 nodes (not 1)"}, "Requires at least 2 nodes (not 1)"},
		{"filtered out by the focus only", "x", &message{Message: "skipped"}, "not selected"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := skipReason(tc.spec, tc.msg, rules); got != tc.want {
				t.Errorf("skipReason = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestReadSkipsRejectsLineWithoutReason(t *testing.T) {
	p := filepath.Join(t.TempDir(), "skips.txt")
	if err := os.WriteFile(p, []byte("\\[Alpha\\]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readSkips(p); err == nil || !strings.Contains(err.Error(), "reason") {
		t.Errorf("readSkips = %v, want an error asking for the reason", err)
	}
}

// TestRepositorySkipsParse: hack/conformance/skips.txt, which run.sh joins into -ginkgo.skip,
// is well formed.
func TestRepositorySkipsParse(t *testing.T) {
	rules, err := readSkips("../skips.txt")
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) == 0 {
		t.Fatal("no rules in skips.txt")
	}
}

// TestMergeKeepsRunOverSkip: the [Disruptive] pass of a multi-node run reports the specs it ran,
// the main pass reported them skipped; the merged summary lists each spec once, with its run.
func TestMergeKeepsRunOverSkip(t *testing.T) {
	main := []result{
		{name: "a", outcome: "passed", seconds: 3},
		{name: "restart", outcome: "skipped", reason: "not selected"},
		{name: "self-skip", outcome: "skipped", reason: "not selected"},
	}
	second := []result{
		{name: "a", outcome: "skipped", reason: "not selected"},
		{name: "restart", outcome: "failed", reason: "boom", seconds: 9},
		{name: "self-skip", outcome: "skipped", reason: "component is not running as pod"},
	}
	got := merge(main, second)
	want := []result{
		{name: "a", outcome: "passed", seconds: 3},
		{name: "restart", outcome: "failed", reason: "boom", seconds: 9},
		{name: "self-skip", outcome: "skipped", reason: "component is not running as pod"},
	}
	if len(got) != len(want) {
		t.Fatalf("merge: got %d results %+v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("merge[%d] = %+v, want %+v", i, got[i], want[i])
		}
	}
}
