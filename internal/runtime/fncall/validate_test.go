package fncall_test

import (
	"strings"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/runtime/fncall"
)

func TestValidate(t *testing.T) {
	ok := fncall.Request{Language: "python", Code: "print(1)"}
	for _, tc := range []struct {
		name   string
		mutate func(*fncall.Request)
		want   string // substring of the error; "" for valid
	}{
		{"valid", func(r *fncall.Request) {}, ""},
		{"alias", func(r *fncall.Request) { r.Language = "python3" }, ""},
		{"all fields", func(r *fncall.Request) {
			r.CompileTimeout, r.RunTimeout, r.MemoryLimitMB, r.MaxOutputBytes = time.Second, time.Second, 64, 10
			r.Files = map[string][]byte{"a/b.txt": nil, "/etc/x": nil, "./c": nil, "d/../e": nil}
			r.FetchFiles = []string{"out", "/abs/out"}
			r.Args = []string{"", "x y"}
		}, ""},
		{"unknown language", func(r *fncall.Request) { r.Language = "cobol" }, `unknown language "cobol" (known: `},
		{"empty language", func(r *fncall.Request) { r.Language = "" }, "language is empty"},
		{"empty code", func(r *fncall.Request) { r.Code = "" }, "code is empty"},
		{"negative compile timeout", func(r *fncall.Request) { r.CompileTimeout = -1 }, "compile_timeout"},
		{"negative run timeout", func(r *fncall.Request) { r.RunTimeout = -time.Second }, "run_timeout"},
		{"negative memory", func(r *fncall.Request) { r.MemoryLimitMB = -1 }, "memory_limit_mb -1 is negative"},
		{"tiny memory", func(r *fncall.Request) { r.MemoryLimitMB = 1 }, "below the minimum"},
		{"negative output bound", func(r *fncall.Request) { r.MaxOutputBytes = -1 }, "max_output_bytes"},
		{"empty file name", func(r *fncall.Request) { r.Files = map[string][]byte{"": nil} }, "files: a file name is empty"},
		{"escaping file", func(r *fncall.Request) { r.Files = map[string][]byte{"../x": nil} }, `"../x" leaves the working directory`},
		{"directory file", func(r *fncall.Request) { r.Files = map[string][]byte{"dir/": nil} }, "names a directory"},
		{"root file", func(r *fncall.Request) { r.Files = map[string][]byte{"/": nil} }, "names a directory"},
		{"NUL in file name", func(r *fncall.Request) { r.Files = map[string][]byte{"a\x00b": nil} }, "NUL"},
		{"file over the source", func(r *fncall.Request) { r.Files = map[string][]byte{"main.py": nil} }, "where the code goes"},
		{"file over the source, absolute", func(r *fncall.Request) { r.Files = map[string][]byte{fncall.WorkDir + "/main.py": nil} }, "where the code goes"},
		{"file and directory", func(r *fncall.Request) { r.Files = map[string][]byte{"a": nil, "a/b": nil} }, `"a" is a file but "a/b" needs it to be a directory`},
		{"file over the working directory", func(r *fncall.Request) { r.Files = map[string][]byte{"/tmp": nil} }, `"/tmp" is a file but the code`},
		{"empty fetch name", func(r *fncall.Request) { r.FetchFiles = []string{"ok", ""} }, "fetch_files: a file name is empty"},
		{"escaping fetch", func(r *fncall.Request) { r.FetchFiles = []string{"a/../../x"} }, "leaves the working directory"},
		{"NUL in args", func(r *fncall.Request) { r.Args = []string{"ok", "a\x00"} }, "args[1] contains a NUL byte"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := ok
			tc.mutate(&r)
			err := r.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("want valid, got %v", err)
			case tc.want != "" && err == nil:
				t.Fatalf("want an error containing %q, got none", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
		})
	}
}
