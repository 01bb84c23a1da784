package fncall

import (
	"slices"
	"strings"
	"testing"
)

// TestTable checks the embedded table: SandboxFusion's names are there,
// every language has packages for the image script, and Lookup resolves
// aliases and names the known languages when it fails.
func TestTable(t *testing.T) {
	for _, name := range []string{"python", "bash", "c", "cpp", "go", "nodejs"} {
		l, err := Lookup(name)
		if err != nil {
			t.Fatalf("Lookup(%q): %v", name, err)
		}
		if l.Name != name || l.Image != DefaultImage || len(l.Packages) == 0 || l.MemoryLimitMB <= 0 {
			t.Errorf("%s: %+v", name, l)
		}
	}
	for alias, name := range map[string]string{"python3": "python", "c++": "cpp", "golang": "go", "node": "nodejs", "javascript": "nodejs"} {
		if l, err := Lookup(alias); err != nil || l.Name != name {
			t.Errorf("Lookup(%q) = %s, %v; want %s", alias, l.Name, err, name)
		}
	}
	for _, name := range []string{"c", "cpp", "go"} {
		if l, _ := Lookup(name); !l.Compiled() {
			t.Errorf("%s is not compiled", name)
		}
	}
	_, err := Lookup("fortran")
	if err == nil || !strings.Contains(err.Error(), `"fortran"`) || !strings.Contains(err.Error(), "python3") {
		t.Errorf("Lookup(fortran) error %v: want it to name the language and list the known ones", err)
	}
	// Callers get copies: editing one does not edit the table.
	l, _ := Lookup("python")
	l.Run[0] = "edited"
	if again, _ := Lookup("python"); again.Run[0] == "edited" {
		t.Error("Lookup returned the table's own slice")
	}
	if n := len(Languages()); n != len(table.langs) || !slices.Contains(Names(), "nodejs") {
		t.Errorf("Languages() has %d, Names() %v", n, Names())
	}
}

func TestParseTableRefuses(t *testing.T) {
	for _, tc := range []struct{ name, json, want string }{
		{"not json", `{`, "unexpected EOF"},
		{"unknown key", `{"languages":[{"name":"x","source":"x","run":["x"],"sourec":"y"}]}`, "unknown field"},
		{"no languages", `{"languages":[]}`, "no languages"},
		{"no name", `{"languages":[{"source":"x","run":["x"]}]}`, "name is empty"},
		{"source path", `{"languages":[{"name":"x","source":"a/b","run":["x"]}]}`, "plain file name"},
		{"no run", `{"languages":[{"name":"x","source":"x"}]}`, "run is empty"},
		{"bad placeholder", `{"languages":[{"name":"x","source":"x","run":["{src}"]}]}`, "unknown placeholder {src}"},
		{"bad env", `{"languages":[{"name":"x","source":"x","run":["x"],"env":["NOEQUALS"]}]}`, "not K=V"},
		{"unknown fork server", `{"languages":[{"name":"x","source":"x","run":["x","{source}"],"fork_server":"nope.py"}]}`, "not a file in forkservers/"},
		{"fork server path", `{"languages":[{"name":"x","source":"x","run":["x","{source}"],"fork_server":"../languages.json"}]}`, "not a file in forkservers/"},
		{"fork server run", `{"languages":[{"name":"x","source":"x","run":["x","-u","{source}"],"fork_server":"python.py"}]}`, "fork_server needs run"},
		{"duplicate", `{"languages":[{"name":"x","source":"x","run":["x"]},{"name":"y","aliases":["x"],"source":"x","run":["x"]}]}`, `"x" is used twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseTable([]byte(tc.json))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
