package tcp

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestEngineTypesStayInTheirFiles keeps the two seams (Engine for accepting, transport for a
// connection) the only way the shared code reaches an engine: outside an engine's own files no
// code names its concrete types, so nothing asserts or switches on them. A third engine then
// lands beside the two without touching the control (conn.go, hold.go, proxy.go, accept.go,
// flows.go).
func TestEngineTypesStayInTheirFiles(t *testing.T) {
	home := map[string][]string{ // a concrete type, and the files that may name it
		"epollEngine": {"engine.go"},
		"epollConn":   {"epoll_conn.go"},
		"uringEngine": {"uring.go", "fallback.go"},
		"uconn":       {"uring.go", "uring_conn.go"},
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			id, ok := n.(*ast.Ident)
			if !ok {
				return true
			}
			allowed, engineType := home[id.Name]
			if engineType && !slices.Contains(allowed, name) {
				t.Errorf("%s names %s, the concrete type of an engine: reach it through Engine or transport (it belongs in %v)",
					fset.Position(id.Pos()), id.Name, allowed)
			}
			return true
		})
	}
}
