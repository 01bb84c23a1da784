package container

import (
	"fmt"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestThrowawayThread checks what Reset's namespace switching relies on:
// the function runs on a thread other than the main one (which the Go
// runtime never ends, and whose namespaces /proc/self shows), with a file
// system context of its own once it unshares it, and that thread is gone
// afterwards, so no goroutine ever runs in the namespaces it joined.
func TestThrowawayThread(t *testing.T) {
	for i := range 50 {
		var tid int
		err := onThrowawayThread(func() error {
			tid = unix.Gettid()
			if tid == unix.Getpid() {
				return fmt.Errorf("ran on the main thread")
			}
			return unix.Unshare(unix.CLONE_FS)
		})
		if err != nil {
			t.Fatalf("run %d: %v", i, err)
		}
		task := fmt.Sprintf("/proc/self/task/%d", tid)
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, err := os.Stat(task); os.IsNotExist(err) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("run %d: thread %d still exists after the function returned", i, tid)
			}
			time.Sleep(time.Millisecond)
		}
	}
}
