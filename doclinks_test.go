package main

import (
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"
	"testing/fstest"
	"unicode"
)

// TestDocLinksResolve checks every relative link of the repository's Markdown (README.md, docs/,
// each package's README.md, bench/RESULTS.md, ...): the file or directory it names exists, and
// its #anchor is a heading of the target as GitHub renders it. The README is short and links into
// docs/, so a moved or renamed section must not leave a dead link behind.
func TestDocLinksResolve(t *testing.T) {
	fsys := os.DirFS(".")
	files, err := markdownFiles(fsys)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"README.md", "docs/running.md", "tcp/README.md"} {
		if !slices.Contains(files, want) {
			t.Fatalf("the walk found no %s (found %v)", want, files)
		}
	}
	problems, err := checkDocLinks(fsys, files)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
}

// TestDocLinkCheckerFindsBrokenLinks keeps the checker honest: each kind of dead link is reported,
// and the forms GitHub resolves are not.
func TestDocLinkCheckerFindsBrokenLinks(t *testing.T) {
	fsys := fstest.MapFS{
		"README.md": {Data: []byte("# Top\n\n" +
			"[ok file](docs/a.md), [ok anchor](docs/a.md#portal-modes-iptables-default-and-bind-no-nat),\n" +
			"[ok dir](docs/), [ok self](#top), [ok second](docs/a.md#flags-1), [ok web](https://example.com/x),\n" +
			"[ok across\nlines](docs/a.md#real-cluster-make-cluster), [ok code](docs/a.md#--io-engine-and-ioengine)\n" +
			"[missing file](docs/nope.md), [missing anchor](docs/a.md#no-such-heading),\n" +
			"[missing self](#nowhere), [outside](../x.md)\n\n" +
			"```\n[in a code block](ignored.md)\n```\n\n" +
			"`[in code](ignored.md)` and [not a ref]: here\n\n[ref]: docs/gone.md\n")},
		"docs/a.md": {Data: []byte("# Portal modes: iptables (default) and bind (no NAT)\n\n" +
			"## Flags\n\n## Flags\n\n### Real cluster (make cluster)\n\n## `--io-engine` and `ioEngine`\n\n" +
			"```sh\n# not a heading\n```\n\n[back](../README.md#top)\n")},
	}
	files, err := markdownFiles(fsys)
	if err != nil {
		t.Fatal(err)
	}
	got, err := checkDocLinks(fsys, files)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		`README.md: link "docs/nope.md": docs/nope.md does not exist`,
		`README.md: link "docs/a.md#no-such-heading": docs/a.md has no heading with anchor #no-such-heading`,
		`README.md: link "#nowhere": README.md has no heading with anchor #nowhere`,
		`README.md: link "../x.md": points outside the repository`,
		`README.md: link "docs/gone.md": docs/gone.md does not exist`,
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("problems:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

// TestGitHubAnchor pins the slugs to what GitHub gives the headings the docs link to.
func TestGitHubAnchor(t *testing.T) {
	for heading, want := range map[string]string{
		"Portal modes: iptables (default) and bind (no NAT)": "portal-modes-iptables-default-and-bind-no-nat",
		"KubePortalProxyDown":                                "kubeportalproxydown",
		"Real cluster (make cluster)":                        "real-cluster-make-cluster",
		"`--io-engine` and `ioEngine`":                       "--io-engine-and-ioengine",
		"After a crash: the restart snapshot":                "after-a-crash-the-restart-snapshot",
		"See [the docs](docs/) first":                        "see-the-docs-first",
		"**Bold** and snake_case":                            "bold-and-snake_case",
		"2026-11-26 (issue 29): 10,000 ports":                "2026-11-26-issue-29-10000-ports",
	} {
		if got := githubAnchor(heading); got != want {
			t.Errorf("githubAnchor(%q) = %q, want %q", heading, got, want)
		}
	}
}

// markdownFiles lists the Markdown files of the tree, leaving out hidden directories, build
// output and test data (fixtures, not documentation).
func markdownFiles(fsys fs.FS) ([]string, error) {
	var files []string
	err := fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "bin") {
				return fs.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("walk the Markdown files: %w", err)
	}
	return files, nil
}

var (
	// fenceRE opens or closes a fenced code block (also indented, inside a list item).
	fenceRE = regexp.MustCompile("^\\s*(```|~~~)")
	// codeSpanRE is an inline code span; its content is never a link.
	codeSpanRE = regexp.MustCompile("(`+)[^`]*?(`+)")
	// inlineLinkRE is [text](target) or ![alt](target), the text possibly across lines, with an
	// optional title.
	inlineLinkRE = regexp.MustCompile(`!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	// refDefRE is a reference definition: [label]: target.
	refDefRE = regexp.MustCompile(`(?m)^ {0,3}\[[^\]]+\]:\s+<?([^\s>]+)>?`)
	// schemeRE starts an absolute URL (https:, mailto:, ...), which is not checked.
	schemeRE   = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)
	headingRE  = regexp.MustCompile(`^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$`)
	htmlIDRE   = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
	mdLinkRE   = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	lineAnchor = regexp.MustCompile(`^L\d+(-L\d+)?$`)
)

// prose returns a Markdown file's text outside fenced code blocks and code spans, with each
// fenced line blanked, so links and headings are read as GitHub renders them.
func prose(md string) []string {
	lines := strings.Split(md, "\n")
	inFence := false
	for i, l := range lines {
		if fenceRE.MatchString(l) {
			inFence = !inFence
			lines[i] = ""
			continue
		}
		if inFence {
			lines[i] = ""
			continue
		}
		lines[i] = codeSpanRE.ReplaceAllStringFunc(l, func(s string) string {
			// Keep the span's text for headings (GitHub slugs it); hide it from the link reader by
			// dropping brackets and parentheses.
			return strings.NewReplacer("[", "", "]", "", "(", "", ")", "").Replace(strings.Trim(s, "`"))
		})
	}
	return lines
}

// githubAnchor is the id GitHub gives a heading: the rendered text lower-cased, every character
// but letters, digits, spaces, hyphens and underscores dropped, spaces turned into hyphens.
func githubAnchor(heading string) string {
	text := mdLinkRE.ReplaceAllString(heading, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.Mn, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// anchors returns the anchors of a Markdown file's headings (repeats get -1, -2, ... as on
// GitHub) and of its explicit <a name> / id anchors.
func anchors(md string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, l := range prose(md) {
		for _, m := range htmlIDRE.FindAllStringSubmatch(l, -1) {
			out[m[1]] = true
		}
		m := headingRE.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		a := githubAnchor(m[2])
		if n := seen[a]; n > 0 {
			out[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// checkDocLinks reads each file's relative links and returns one line per link that does not
// resolve; err is for a file it could not read.
func checkDocLinks(fsys fs.FS, files []string) ([]string, error) {
	anchorCache := map[string]map[string]bool{}
	anchorsOf := func(name string) (map[string]bool, error) {
		if a, ok := anchorCache[name]; ok {
			return a, nil
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", name, err)
		}
		anchorCache[name] = anchors(string(b))
		return anchorCache[name], nil
	}
	var problems []string
	for _, file := range files {
		b, err := fs.ReadFile(fsys, file)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", file, err)
		}
		text := strings.Join(prose(string(b)), "\n")
		var targets []string
		for _, m := range inlineLinkRE.FindAllStringSubmatch(text, -1) {
			targets = append(targets, m[1])
		}
		for _, m := range refDefRE.FindAllStringSubmatch(text, -1) {
			targets = append(targets, m[1])
		}
		for _, target := range targets {
			if schemeRE.MatchString(target) || strings.HasPrefix(target, "//") {
				continue
			}
			problem, err := checkLink(fsys, file, target, anchorsOf)
			if err != nil {
				return nil, err
			}
			if problem != "" {
				problems = append(problems, fmt.Sprintf("%s: link %q: %s", file, target, problem))
			}
		}
	}
	return problems, nil
}

// checkLink resolves one relative link of file as GitHub does (relative to the file's directory,
// or to the repository root with a leading slash) and returns what is wrong with it, or "".
func checkLink(fsys fs.FS, file, target string, anchorsOf func(string) (map[string]bool, error)) (string, error) {
	p, frag, _ := strings.Cut(target, "#")
	if dec, err := url.PathUnescape(p); err == nil {
		p = dec
	}
	name := file
	if p != "" {
		if strings.HasPrefix(p, "/") {
			name = path.Clean(strings.TrimPrefix(p, "/"))
		} else {
			name = path.Join(path.Dir(file), p)
		}
		if name == ".." || strings.HasPrefix(name, "../") {
			return "points outside the repository", nil
		}
		if _, err := fs.Stat(fsys, name); err != nil {
			return name + " does not exist", nil
		}
	}
	if frag == "" {
		return "", nil
	}
	if !strings.HasSuffix(name, ".md") {
		if lineAnchor.MatchString(frag) {
			return "", nil
		}
		return fmt.Sprintf("anchor #%s on %s, which is not Markdown", frag, name), nil
	}
	a, err := anchorsOf(name)
	if err != nil {
		return "", err
	}
	if !a[frag] {
		return fmt.Sprintf("%s has no heading with anchor #%s", name, frag), nil
	}
	return "", nil
}
