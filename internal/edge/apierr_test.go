package edge

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/dsec-dev/dsec/internal/fail"
)

// TestAPIError: each kind becomes its code with the classified error's
// message (no prefix from what wraps it), a retry hint becomes
// Retry-After, and a Connect error or an unclassified error passes as it
// is.
func TestAPIError(t *testing.T) {
	for kind, code := range codes {
		err := fmt.Errorf("outer: %w", fail.Errorf(kind, "sandbox %q is frozen", "x"))
		got := apiError(err)
		if connect.CodeOf(got) != code {
			t.Errorf("kind %v: code %v, want %v", kind, connect.CodeOf(got), code)
		}
		var ce *connect.Error
		if !errors.As(got, &ce) || ce.Message() != `sandbox "x" is frozen` {
			t.Errorf("kind %v: message %q", kind, got)
		}
		if kind.String() != code.String() {
			t.Errorf("kind %v is named unlike its code %v (trajectory records store the name)", kind, code)
		}
	}
	if len(codes) != int(fail.Unauthenticated)+1 {
		t.Fatalf("%d kinds mapped, want every kind", len(codes))
	}
	hint := apiError(fail.RetryAfter(fail.Unavailable, errors.New("queue full"), 1500*time.Millisecond))
	var ce *connect.Error
	if !errors.As(hint, &ce) || ce.Meta().Get("Retry-After") != "2" {
		t.Fatalf("retry hint: %v %v", hint, ce.Meta())
	}
	passed := connect.NewError(connect.CodeInvalidArgument, errors.New("argv[1] has a NUL byte"))
	if apiError(passed) != passed {
		t.Fatal("a Connect error was not passed as it is")
	}
	plain := errors.New("plain")
	if apiError(plain) != plain || apiCode(plain) != connect.CodeUnknown {
		t.Fatal("an unclassified error was changed")
	}
	if apiError(nil) != nil {
		t.Fatal("nil mapped to an error")
	}
	if got := apiMessage(fail.Errorf(fail.NotFound, "gone")); got != "gone" {
		t.Fatalf("apiMessage %q", got)
	}
	if got := apiText(fail.Errorf(fail.NotFound, "gone")); got != "not_found: gone" {
		t.Fatalf("apiText %q", got)
	}
}

// TestConnectErrorsAtTheBoundaryOnly: no file of the edge but the service
// boundary's builds a Connect error, so that a kind's code is decided in
// one place.
func TestConnectErrorsAtTheBoundaryOnly(t *testing.T) {
	allowed := map[string]bool{
		"apierr.go":  true, // the mapping
		"service.go": true, // RequireClusterToken answers before any handler runs
	}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") || allowed[name] {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); ok && id.Name == "connect" && (sel.Sel.Name == "NewError" || strings.HasPrefix(sel.Sel.Name, "Code")) {
				t.Errorf("%s: connect.%s outside the service boundary (return a fail error)", fset.Position(sel.Pos()), sel.Sel.Name)
			}
			return true
		})
	}
}
