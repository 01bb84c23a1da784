package layer

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkCopyTree copies a tree like statebench's checkpoint upper
// (three fresh 1 MiB files and a small file in a directory), as a
// checkpoint does.
func BenchmarkCopyTree(b *testing.B) {
	src := b.TempDir()
	buf := make([]byte, 1<<20)
	for i := 1; i <= 3; i++ {
		rand.Read(buf)
		if err := os.WriteFile(filepath.Join(src, fmt.Sprintf("f%d", i)), buf, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(src, "root", "ck"), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "root", "ck", "marker"), []byte("rep-1\n"), 0o644); err != nil {
		b.Fatal(err)
	}
	dst := b.TempDir()
	b.SetBytes(3 << 20)
	b.ResetTimer()
	for i := range b.N {
		if _, err := CopyTree(context.Background(), src, filepath.Join(dst, fmt.Sprint(i))); err != nil {
			b.Fatal(err)
		}
	}
}
