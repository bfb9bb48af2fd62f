// Command summary turns the JUnit report of a make conformance run into the summary table
// (bin/conformance/summary.md): every spec the run's focus selects, passed, failed or skipped,
// with the reason a spec was skipped (the skips.txt line whose expression matched it, or the
// spec's own message when it skipped itself, e.g. for want of a second node) or the first line
// of its failure. -junit takes several reports, comma-separated (make conformance NODES=3 runs the
// [Disruptive] specs in a second pass): a spec that ran in one report and was skipped in another
// is listed with its run.
//
//	go run ./hack/conformance/summary -junit bin/conformance/junit_01.xml \
//	    -skips hack/conformance/skips.txt -focus '...' -o bin/conformance/summary.md
package main

import (
	"bufio"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// junit is the part of a ginkgo JUnit report the summary reads.
type junit struct {
	Suites []struct {
		Cases []testCase `xml:"testcase"`
	} `xml:"testsuite"`
}

type testCase struct {
	Name    string   `xml:"name,attr"`
	Status  string   `xml:"status,attr"`
	Time    float64  `xml:"time,attr"`
	Skipped *message `xml:"skipped"`
	Failure *message `xml:"failure"`
	Error   *message `xml:"error"`
}

type message struct {
	Message string `xml:"message,attr"`
	Body    string `xml:",chardata"`
}

// skipRule is one line of skips.txt.
type skipRule struct {
	re     *regexp.Regexp
	reason string
}

// result is one spec's line in the summary.
type result struct {
	name    string
	outcome string // passed, failed, skipped
	reason  string
	seconds float64
}

func main() {
	junitPath := flag.String("junit", "", "JUnit report(s) written by e2e.test -report-dir, comma-separated")
	skipsPath := flag.String("skips", "", "skips.txt: expression<TAB>reason per line")
	focus := flag.String("focus", "", "the run's -ginkgo.focus: specs it does not select are left out")
	out := flag.String("o", "", "summary file (default stdout)")
	flag.Parse()
	if *junitPath == "" || *skipsPath == "" {
		fmt.Fprintln(os.Stderr, "usage: summary -junit FILE -skips skips.txt [-focus RE] [-o FILE]")
		os.Exit(2)
	}
	if err := run(*junitPath, *skipsPath, *focus, *out); err != nil {
		fmt.Fprintln(os.Stderr, "summary:", err)
		os.Exit(1)
	}
}

func run(junitPath, skipsPath, focus, out string) error {
	rules, err := readSkips(skipsPath)
	if err != nil {
		return err
	}
	var focusRE *regexp.Regexp
	if focus != "" {
		if focusRE, err = regexp.Compile(focus); err != nil {
			return fmt.Errorf("focus %q: %w", focus, err)
		}
	}
	var reports [][]result
	for _, path := range strings.Split(junitPath, ",") {
		rs, err := summarizeFile(path, rules, focusRE)
		if err != nil {
			return err
		}
		reports = append(reports, rs)
	}
	results := merge(reports...)
	w := io.Writer(os.Stdout)
	if out != "" {
		o, err := os.Create(out)
		if err != nil {
			return fmt.Errorf("summary: %w", err)
		}
		defer o.Close()
		w = o
	}
	return write(w, results)
}

func summarizeFile(path string, rules []skipRule, focus *regexp.Regexp) ([]result, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("junit report: %w", err)
	}
	defer f.Close()
	results, err := summarize(f, rules, focus)
	if err != nil {
		return nil, fmt.Errorf("junit report %s: %w", path, err)
	}
	return results, nil
}

// merge joins the results of several runs of one selection into one list, in name order: a
// spec that ran (passed or failed) in one report keeps that result over a skip in another; of
// two runs or two skips, the later report's stands.
func merge(reports ...[]result) []result {
	byName := map[string]result{}
	for _, rs := range reports {
		for _, r := range rs {
			if prev, ok := byName[r.name]; ok && prev.outcome != "skipped" && r.outcome == "skipped" {
				continue
			}
			byName[r.name] = r
		}
	}
	merged := make([]result, 0, len(byName))
	for _, r := range byName {
		merged = append(merged, r)
	}
	sort.Slice(merged, func(i, j int) bool { return merged[i].name < merged[j].name })
	return merged
}

func readSkips(path string) ([]skipRule, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("skips: %w", err)
	}
	defer f.Close()
	var rules []skipRule
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			continue
		}
		expr, reason, ok := strings.Cut(line, "\t")
		if !ok {
			return nil, fmt.Errorf("skips %s:%d: want expression<TAB>reason", path, n)
		}
		re, err := regexp.Compile(expr)
		if err != nil {
			return nil, fmt.Errorf("skips %s:%d: %w", path, n, err)
		}
		rules = append(rules, skipRule{re: re, reason: reason})
	}
	return rules, sc.Err()
}

// summarize reads a JUnit report and returns the specs the focus selects, in name order. Suite
// set-up and tear-down entries ([SynchronizedBeforeSuite] and the like) are left out.
func summarize(r io.Reader, rules []skipRule, focus *regexp.Regexp) ([]result, error) {
	var report junit
	if err := xml.NewDecoder(r).Decode(&report); err != nil {
		return nil, err
	}
	var results []result
	for _, s := range report.Suites {
		for _, c := range s.Cases {
			name := strings.TrimPrefix(c.Name, "[It] ")
			if !strings.HasPrefix(name, "[sig-") {
				continue // [SynchronizedBeforeSuite], [ReportAfterSuite], ...
			}
			if focus != nil && !focus.MatchString(name) {
				continue
			}
			res := result{name: name, seconds: c.Time}
			switch {
			case c.Failure != nil || c.Error != nil || c.Status == "failed" || c.Status == "panicked" || c.Status == "timedout":
				res.outcome = "failed"
				m := c.Failure
				if m == nil {
					m = c.Error
				}
				if m != nil {
					res.reason = firstLine(m.Message, m.Body)
				}
			case c.Skipped != nil || c.Status == "skipped" || c.Status == "pending":
				res.outcome = "skipped"
				res.reason = skipReason(name, c.Skipped, rules)
			default:
				res.outcome = "passed"
			}
			results = append(results, res)
		}
	}
	if len(results) == 0 {
		return nil, errors.New("no spec matches the focus")
	}
	sort.Slice(results, func(i, j int) bool { return results[i].name < results[j].name })
	return results, nil
}

// skipReason is the skips.txt reason of the first rule that matches the spec's name, else the
// message the spec skipped itself with.
func skipReason(name string, m *message, rules []skipRule) string {
	for _, r := range rules {
		if r.re.MatchString(name) {
			return r.reason
		}
	}
	if m != nil {
		msg := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(m.Message), "skipped"))
		msg = strings.TrimSpace(strings.TrimPrefix(msg, "-"))
		if msg != "" {
			return firstLine(msg, "")
		}
		if l := firstLine(m.Body, ""); l != "" {
			return l
		}
	}
	return "not selected"
}

func firstLine(texts ...string) string {
	for _, t := range texts {
		for _, l := range strings.Split(t, "\n") {
			if l = strings.TrimSpace(l); l != "" {
				if len(l) > 200 {
					l = l[:200] + "…"
				}
				return l
			}
		}
	}
	return ""
}

func write(w io.Writer, results []result) error {
	count := map[string]int{}
	for _, r := range results {
		count[r.outcome]++
	}
	ran := count["passed"] + count["failed"]
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "# Conformance summary\n\n%d specs selected: %d passed, %d failed, %d skipped (%d of %d run passed)\n\n",
		len(results), count["passed"], count["failed"], count["skipped"], count["passed"], ran)
	fmt.Fprintln(bw, "| result | spec | seconds | reason |")
	fmt.Fprintln(bw, "|---|---|---|---|")
	for _, outcome := range []string{"failed", "passed", "skipped"} {
		for _, r := range results {
			if r.outcome != outcome {
				continue
			}
			secs := ""
			if r.outcome != "skipped" {
				secs = fmt.Sprintf("%.0f", r.seconds)
			}
			fmt.Fprintf(bw, "| %s | %s | %s | %s |\n", r.outcome, cell(r.name), secs, cell(r.reason))
		}
	}
	return bw.Flush()
}

// cell escapes what would break a Markdown table cell.
func cell(s string) string {
	return strings.NewReplacer("|", `\|`, "\n", " ").Replace(s)
}
