package udp

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoopIOIsTheOnlyWayToTheSockets keeps loopIO the seam between a loop's logic and its I/O:
// outside epoll.go no code names epollIO or calls the datagram and epoll system calls itself,
// so a second implementation (io_uring) lands beside epollIO without touching the loop.
func TestLoopIOIsTheOnlyWayToTheSockets(t *testing.T) {
	private := map[string]bool{"epollIO": true, "recvmmsg": true, "sendmmsg": true, "sendDatagram": true}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") || name == "epoll.go" {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.Ident:
				if private[n.Name] {
					t.Errorf("%s names %s: the loop's I/O goes through loopIO (epoll.go)", fset.Position(n.Pos()), n.Name)
				}
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok && x.Name == "unix" && strings.HasPrefix(n.Sel.Name, "Epoll") {
					t.Errorf("%s calls unix.%s: the loop's I/O goes through loopIO (epoll.go)", fset.Position(n.Pos()), n.Sel.Name)
				}
			}
			return true
		})
	}
}
