package agent

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// identity is who an exec runs as, resolved from the sandbox's own
// /etc/passwd and /etc/group (not the host's: the agent runs after
// pivot_root, and os/user would also pull in more than the agent needs).
type identity struct {
	uid, gid uint32
	groups   []uint32 // supplementary
	home     string
}

// lookupUser resolves "user", "uid", "user:group" or "uid:gid". A numeric
// uid need not exist in /etc/passwd (like Docker: gid 0, home /).
func lookupUser(etcDir, spec string) (*identity, error) {
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	if userPart == "" || (hasGroup && groupPart == "") {
		return nil, errorf(CodeInvalidArgument, "user %q: want name, uid, name:group or uid:gid", spec)
	}
	passwd := filepath.Join(etcDir, "passwd")
	groupFile := filepath.Join(etcDir, "group")

	id := &identity{home: "/"}
	name := ""
	if n, err := strconv.ParseUint(userPart, 10, 32); err == nil {
		id.uid = uint32(n)
		if e := findEntry(passwd, 2, userPart); e != nil {
			name = e[0]
			id.gid = parseID(e[3])
			id.home = nonEmpty(e[5], "/")
		}
	} else {
		e := findEntry(passwd, 0, userPart)
		if e == nil {
			return nil, errorf(CodeNotFound, "user %q not found in %s", userPart, passwd)
		}
		name = userPart
		id.uid = parseID(e[2])
		id.gid = parseID(e[3])
		id.home = nonEmpty(e[5], "/")
	}
	if hasGroup {
		if n, err := strconv.ParseUint(groupPart, 10, 32); err == nil {
			id.gid = uint32(n)
		} else {
			e := findEntry(groupFile, 0, groupPart)
			if e == nil {
				return nil, errorf(CodeNotFound, "group %q not found in %s", groupPart, groupFile)
			}
			id.gid = parseID(e[2])
		}
	}
	id.groups = []uint32{}
	if name != "" {
		eachEntry(groupFile, func(f []string) bool {
			if len(f) < 4 {
				return true
			}
			for m := range strings.SplitSeq(f[3], ",") {
				if strings.TrimSpace(m) == name {
					if g := parseID(f[2]); g != id.gid {
						id.groups = append(id.groups, g)
					}
					break
				}
			}
			return true
		})
	}
	return id, nil
}

// homeOf returns the home directory of uid, or "/".
func homeOf(etcDir string, uid int) string {
	if e := findEntry(filepath.Join(etcDir, "passwd"), 2, strconv.Itoa(uid)); e != nil {
		return nonEmpty(e[5], "/")
	}
	return "/"
}

// findEntry returns the first line of a colon-separated database whose
// field col equals val (passwd lines have 7 fields, group lines 4).
func findEntry(path string, col int, val string) []string {
	var found []string
	eachEntry(path, func(f []string) bool {
		if len(f) > col && f[col] == val && len(f) >= 4 {
			if len(f) < 7 {
				f = append(f, make([]string, 7-len(f))...)
			}
			found = f
			return false
		}
		return true
	})
	return found
}

func eachEntry(path string, fn func([]string) bool) {
	f, err := os.Open(path)
	if err != nil {
		return
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		if !fn(strings.Split(line, ":")) {
			return
		}
	}
}

func parseID(s string) uint32 {
	n, _ := strconv.ParseUint(s, 10, 32)
	return uint32(n)
}

func nonEmpty(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
