package agent

import (
	"bytes"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsec-dev/dsec/internal/rawfile"
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
		e, err := findEntry(passwd, 2, userPart)
		if err != nil {
			return nil, unusable(spec, err)
		}
		if e != nil {
			name = e[0]
			id.gid = parseID(e[3])
			id.home = nonEmpty(e[5], "/")
		}
	} else {
		e, err := findEntry(passwd, 0, userPart)
		if err != nil {
			return nil, unusable(spec, err)
		}
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
			e, err := findEntry(groupFile, 0, groupPart)
			if err != nil {
				return nil, unusable(spec, err)
			}
			if e == nil {
				return nil, errorf(CodeNotFound, "group %q not found in %s", groupPart, groupFile)
			}
			id.gid = parseID(e[2])
		}
	}
	id.groups = []uint32{}
	if name != "" {
		err := eachEntry(groupFile, func(f []string) bool {
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
		if err != nil {
			return nil, unusable(spec, err)
		}
	}
	return id, nil
}

// unusable is the error for a passwd or group file the agent refuses to
// read (not a regular file, too large): the sandbox's own doing.
func unusable(spec string, err error) error {
	return errorf(CodeFailedPrecondition, "user %q: %v", spec, err)
}

// homeOf returns the home directory of uid, or "/".
func homeOf(etcDir string, uid int) string {
	if e, _ := findEntry(filepath.Join(etcDir, "passwd"), 2, strconv.Itoa(uid)); e != nil {
		return nonEmpty(e[5], "/")
	}
	return "/"
}

// homeCache remembers homeOf's last answer with the passwd file's identity
// (device, inode, size, modification and change times): every exec without
// HOME in its environment needs it, and reading the file on the sandbox's
// overlay (an open, two reads, a close) cost about 6 % of the agent's CPU
// in an exec loop, where checking that it is unchanged is one stat. Any
// write to the file sets its ctime to the current time, and a file renamed
// over it has another inode. File times have the kernel's coarse clock
// (milliseconds), so two writes of the same size in one tick leave the
// same identity: an answer is kept only when the file's ctime was more
// than a second old when it was read, and a file changed within the last
// second is read on every exec.
type homeCache struct {
	mu   sync.Mutex
	ok   bool
	id   [6]int64
	uid  int
	home string
}

func (c *homeCache) get(etcDir string, uid int) string {
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(etcDir, "passwd"), &st); err != nil {
		return homeOf(etcDir, uid)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return "/" // a FIFO, /dev/zero: not read (and homeOf would refuse it)
	}
	id := [6]int64{int64(st.Dev), int64(st.Ino), st.Size, st.Mtim.Nano(), st.Ctim.Nano(), int64(st.Nlink)}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ok && c.id == id && c.uid == uid {
		return c.home
	}
	settled := time.Since(time.Unix(0, st.Ctim.Nano())) > time.Second
	c.home, c.id, c.uid, c.ok = homeOf(etcDir, uid), id, uid, settled
	return c.home
}

// findEntry returns the first line of a colon-separated database whose
// field col equals val (passwd lines have 7 fields, group lines 4). A
// missing file has no entries; one the agent refuses to read is an error.
func findEntry(path string, col int, val string) ([]string, error) {
	var found []string
	err := eachEntry(path, func(f []string) bool {
		if len(f) > col && f[col] == val && len(f) >= 4 {
			if len(f) < 7 {
				f = append(f, make([]string, 7-len(f))...)
			}
			found = f
			return false
		}
		return true
	})
	return found, err
}

// eachEntry calls fn with the fields of each line of a colon-separated
// database until fn returns false. The file is read with plain system
// calls into one buffer: every exec without HOME in its environment looks
// its user up, and an *os.File, a bufio.Scanner and a string per line cost
// more than the lookup.
//
// The sandbox's workload owns the file: it is read only if it is a regular
// file of at most maxDatabase bytes, opened so that a FIFO cannot block
// PID 1 and a link to /dev/zero is not read without end (rawfile.
// ReadRegular); anything else is an error. A missing or unreadable file
// has no entries, as before.
func eachEntry(path string, fn func([]string) bool) error {
	b, err := rawfile.ReadRegular(path, maxDatabase)
	if errors.Is(err, rawfile.ErrNotRegular) || errors.Is(err, rawfile.ErrTooLarge) {
		return err
	}
	if err != nil {
		return nil
	}
	var fields [8]string
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'}) // as bufio.ScanLines did
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		// One string per line; the fields are slices of it.
		l := string(line)
		f := fields[:0]
		for {
			i := strings.IndexByte(l, ':')
			if i < 0 || len(f) == len(fields)-1 {
				f = append(f, l)
				break
			}
			f = append(f, l[:i])
			l = l[i+1:]
		}
		if len(f) == len(fields) {
			f = strings.Split(string(line), ":") // more fields than any database has
		}
		if !fn(f) {
			return nil
		}
	}
	return nil
}

// maxDatabase bounds the passwd and group files the agent reads (real
// ones are kilobytes; a directory service's full dump, a few megabytes).
const maxDatabase = 4 << 20

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
