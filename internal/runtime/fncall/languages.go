package fncall

import (
	"bytes"
	"embed"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// DefaultImage is the image (NAME:TAG) every language runs in unless the
// table overrides it: the Debian rootfs scripts/langimage.sh builds.
const DefaultImage = "dsec/lang:bookworm"

// Language says how to compile and run one language. It comes from the
// table in languages.json; adding a language needs no code.
type Language struct {
	// Name is the canonical name (SandboxFusion's: python, bash, c, cpp,
	// go, nodejs); Aliases are other names Lookup accepts.
	Name    string   `json:"name"`
	Aliases []string `json:"aliases,omitempty"`
	// Source is the file name the code is written to in the working
	// directory (main.py, main.c, ...).
	Source string `json:"source"`
	// Compile is the compiler's argv; empty for interpreted languages.
	// Compile, Run and Env may use {workdir}, {source} and {binary}.
	Compile []string `json:"compile,omitempty"`
	// Run is the program's argv; the request's Args are appended.
	Run []string `json:"run"`
	// Env is extra K=V for both steps (Go's caches, for instance).
	Env []string `json:"env,omitempty"`
	// MemoryLimitMB is the call's memory limit when the request sets none.
	MemoryLimitMB int64 `json:"memory_limit_mb,omitempty"`
	// Packages are the Debian packages the image needs for this language
	// (read by scripts/langimage.sh).
	Packages []string `json:"packages,omitempty"`
	// Image overrides DefaultImage; Lookup fills it in.
	Image string `json:"image,omitempty"`
	// ForkServer names a fork server in forkservers/ (e.g. "python.py"):
	// a program for Run's interpreter that, started once per sandbox, runs
	// each call as a fork of itself instead of a new interpreter (see
	// runtime.Forker). Only for a run of the form [INTERPRETER, "{source}"].
	ForkServer string `json:"fork_server,omitempty"`
}

// Compiled reports whether the language has a compile step.
func (l Language) Compiled() bool { return len(l.Compile) > 0 }

//go:embed languages.json
var tableJSON []byte

// forkServers holds the fork servers a language may name.
//
//go:embed forkservers
var forkServers embed.FS

// forkServerArgv is the argv that starts lang's fork server, or nil.
func forkServerArgv(l Language) []string {
	if l.ForkServer == "" {
		return nil
	}
	script, err := forkServers.ReadFile("forkservers/" + l.ForkServer)
	if err != nil {
		return nil // parseTable refused such a table
	}
	return []string{l.Run[0], "-c", string(script)}
}

// table is the parsed language table, by canonical name and by alias.
var table = mustParseTable(tableJSON)

type languageTable struct {
	langs  []Language // in file order
	byName map[string]int
}

func mustParseTable(b []byte) languageTable {
	t, err := parseTable(b)
	if err != nil {
		// The table is embedded: a bad one is a build defect, and the
		// package's tests fail on it before it ships.
		panic("fncall: languages.json: " + err.Error())
	}
	return t
}

// placeholders are the names argv and env entries may use.
var placeholders = []string{"{workdir}", "{source}", "{binary}"}

func parseTable(b []byte) (languageTable, error) {
	var doc struct {
		Comment   string     `json:"comment"`
		Languages []Language `json:"languages"`
	}
	// Unknown fields are refused: a misspelt key would otherwise be a
	// silently missing setting.
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&doc); err != nil {
		return languageTable{}, err
	}
	t := languageTable{byName: map[string]int{}}
	for i, l := range doc.Languages {
		if l.Name == "" {
			return t, fmt.Errorf("languages[%d]: name is empty", i)
		}
		if l.Source == "" || strings.ContainsRune(l.Source, '/') {
			return t, fmt.Errorf("language %s: source must be a plain file name, got %q", l.Name, l.Source)
		}
		if len(l.Run) == 0 {
			return t, fmt.Errorf("language %s: run is empty", l.Name)
		}
		if l.MemoryLimitMB < 0 {
			return t, fmt.Errorf("language %s: memory_limit_mb is negative", l.Name)
		}
		for _, s := range slices.Concat(l.Compile, l.Run, l.Env) {
			if err := checkPlaceholders(s); err != nil {
				return t, fmt.Errorf("language %s: %w", l.Name, err)
			}
		}
		for _, e := range l.Env {
			if k, _, ok := strings.Cut(e, "="); !ok || k == "" {
				return t, fmt.Errorf("language %s: env entry %q is not K=V", l.Name, e)
			}
		}
		if l.ForkServer != "" {
			if _, err := forkServers.ReadFile("forkservers/" + l.ForkServer); err != nil || strings.ContainsRune(l.ForkServer, '/') {
				return t, fmt.Errorf("language %s: fork_server %q is not a file in forkservers/", l.Name, l.ForkServer)
			}
			if len(l.Run) != 2 || l.Run[1] != "{source}" {
				return t, fmt.Errorf("language %s: fork_server needs run = [INTERPRETER, \"{source}\"], got %q", l.Name, l.Run)
			}
		}
		if l.Image == "" {
			l.Image = DefaultImage
		}
		t.langs = append(t.langs, l)
		for _, name := range append([]string{l.Name}, l.Aliases...) {
			if _, dup := t.byName[name]; dup {
				return t, fmt.Errorf("language name %q is used twice", name)
			}
			t.byName[name] = len(t.langs) - 1
		}
	}
	if len(t.langs) == 0 {
		return t, fmt.Errorf("no languages")
	}
	return t, nil
}

// checkPlaceholders refuses a {name} that expand would leave as it is.
func checkPlaceholders(s string) error {
	for rest := s; ; {
		i := strings.IndexByte(rest, '{')
		if i < 0 {
			return nil
		}
		j := strings.IndexByte(rest[i:], '}')
		if j < 0 {
			return nil
		}
		if p := rest[i : i+j+1]; !slices.Contains(placeholders, p) {
			return fmt.Errorf("unknown placeholder %s in %q (known: %s)", p, s, strings.Join(placeholders, ", "))
		}
		rest = rest[i+j+1:]
	}
}

// Lookup returns the language called name (canonical name or alias).
func Lookup(name string) (Language, error) {
	i, ok := table.byName[name]
	if !ok {
		if name == "" {
			return Language{}, fmt.Errorf("language is empty (known: %s)", strings.Join(Names(), ", "))
		}
		return Language{}, fmt.Errorf("unknown language %q (known: %s)", name, strings.Join(Names(), ", "))
	}
	return cloneLanguage(table.langs[i]), nil
}

// Languages returns every language of the table, in table order.
func Languages() []Language {
	out := make([]Language, len(table.langs))
	for i, l := range table.langs {
		out[i] = cloneLanguage(l)
	}
	return out
}

// Names returns every name Lookup accepts, aliases included, sorted.
func Names() []string {
	names := make([]string, 0, len(table.byName))
	for n := range table.byName {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// cloneLanguage copies the slices so callers cannot edit the table.
func cloneLanguage(l Language) Language {
	l.Aliases = slices.Clone(l.Aliases)
	l.Compile = slices.Clone(l.Compile)
	l.Run = slices.Clone(l.Run)
	l.Env = slices.Clone(l.Env)
	l.Packages = slices.Clone(l.Packages)
	return l
}
