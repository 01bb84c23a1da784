package fncall_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	rt "github.com/dsec-dev/dsec/internal/runtime"
	"github.com/dsec-dev/dsec/internal/runtime/fncall"
)

// TestOnlyStdio: a program of every language of the table starts with
// stdin, stdout and stderr and nothing of the platform's: not the agent's
// control channel, not a descriptor dsecd inherited, not a fork server's
// connection to the edge (python runs as a fork of one, twice here: the
// second call in a sandbox reset since is a fork of the same server). Each
// language's testdata/programs/<language>/fds prints "FD TARGET" for the
// descriptors it holds (a shell's: ls -l of them); what its own runtime
// opened (an epoll instance, an eventfd, a pipe it holds both ends of, the
// script a shell reads, node's /dev/null) and the directory it lists are
// allowed.
func TestOnlyStdio(t *testing.T) {
	e := newEnv(t)
	for _, lang := range fncall.Languages() {
		t.Run(lang.Name, func(t *testing.T) {
			code, err := os.ReadFile(filepath.Join("testdata", "programs", lang.Name, "fds"))
			if err != nil {
				t.Fatalf("language %s needs a test program fds: %v", lang.Name, err)
			}
			sb := e.sandbox(t)
			for i := range 2 {
				if i > 0 {
					reset(t, sb)
				}
				r := fncall.Call(context.Background(), sb, lang, fncall.Request{Language: lang.Name, Code: string(code)}, rt.Resources{})
				if r.Status != fncall.StatusSuccess || r.Run == nil {
					t.Fatalf("call %d: want Success, got %s", i, describe(r))
				}
				type fd struct{ fd, target string }
				var fds []fd
				held := map[string]int{}
				for _, line := range strings.Split(strings.TrimSpace(string(r.Run.Stdout)), "\n") {
					var f fd
					if l, target, ok := strings.Cut(line, " -> "); ok { // ls -l
						w := strings.Fields(l)
						f = fd{w[len(w)-1], target}
					} else if strings.HasPrefix(line, "total ") {
						continue
					} else {
						f.fd, f.target, _ = strings.Cut(line, " ")
					}
					fds = append(fds, f)
					held[f.target]++
				}
				for _, f := range fds {
					fd, target := f.fd, f.target
					switch {
					case fd == "0" || fd == "1" || fd == "2":
					case strings.HasPrefix(target, "anon_inode:"): // the runtime's own
					case strings.HasPrefix(target, "pipe:") && held[target] == 2: // a pipe to itself
					case strings.HasSuffix(target, "/"+lang.Source): // a shell's script
					case target == "/dev/null" && lang.Name == "nodejs": // node opens one itself
					case target == "" || (strings.HasPrefix(target, "/proc/") && strings.HasSuffix(target, "/fd")):
						// the listing itself (gone by the time it is read, in a shell)
					default:
						t.Errorf("call %d: the program holds fd %s -> %s (all:\n%s)", i, fd, target, r.Run.Stdout)
					}
				}
			}
		})
	}
}
