package testsuite

import (
	"strings"
	"testing"

	"github.com/dsec-dev/dsec/internal/runtime"
)

// inodeWrites makes the kinds of directory entries a root file system
// holds: a directory and files only in the writable layer (with a hard
// link), a copied-up directory (/etc, by a new file in it) and a copied-up
// file (/etc/passwd), a directory whose metadata alone was copied up
// (/bin), beside the image's untouched entries.
const inodeWrites = `set -e
mkdir -p /inode-new/sub && echo a > /inode-new/f && ln /inode-new/f /inode-new/link
echo b > /etc/inode-copied-up && echo 'x:x:1000:1000::/:/bin/sh' >> /etc/passwd
chmod 755 /bin`

// inodeDirs are the directories whose entries testInodeNumbers compares.
var inodeDirs = []string{"/", "/etc", "/bin", "/inode-new", "/inode-new/sub", "/tmp"}

// testInodeNumbers: for every entry of a directory, the inode number
// readdir gives is the one lstat gives, and every entry of one file system
// has its st_dev (find -inum, du, rsync, tar and hard-link detection rely
// on both). Over layers on several file systems overlayfs gives neither
// without xino. Checked in a new sandbox and in roots that Reset and
// Rebase build.
func (s *suite) testInodeNumbers(t *testing.T) {
	s.need(t, LayerRootfs)
	sb := s.create(t, nil)
	check := func(when string) {
		t.Helper()
		s.sh(t, sb, inodeWrites)
		probe := s.infoProbe(t, sb)
		out := strings.TrimSpace(s.sh(t, sb, probe+" inodes "+strings.Join(inodeDirs, " ")))
		lines := strings.Split(out, "\n")
		last := lines[len(lines)-1]
		if !strings.HasPrefix(last, "checked ") || last == "checked 0" {
			t.Fatalf("%s: infoprobe inodes printed %q", when, out)
		}
		if len(lines) > 1 {
			t.Errorf("%s: readdir and lstat disagree (%s entries):\n%s", when, strings.TrimPrefix(last, "checked "), strings.Join(lines[:len(lines)-1], "\n"))
		}
		links := strings.Fields(s.sh(t, sb, `stat -c %i /inode-new/f /inode-new/link`))
		if len(links) != 2 || links[0] != links[1] {
			t.Errorf("%s: hard links have inode numbers %q", when, links)
		}
	}
	check("fresh sandbox")
	if _, ok := sb.(runtime.Resetter); ok {
		s.reset(t, sb) // the writes above make it build a new root
		check("after Reset")
	}
	if r, ok := sb.(runtime.Rebaser); ok {
		if err := r.Rebase(s.ctx(t), s.h.NewSpec(t)); err != nil {
			t.Fatalf("Rebase: %v", err)
		}
		check("after Rebase")
	}
}
