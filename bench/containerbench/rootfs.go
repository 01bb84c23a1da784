package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// busyboxPath is the static busybox that every system's rootfs is made of
// (Debian's busybox-static package).
const busyboxPath = "/bin/busybox"

// buildRootfs makes a minimal busybox tree in dir: /bin/busybox plus one
// relative symlink per applet (so the links resolve inside any chroot, which
// `busybox --install -s` would not guarantee: it links to its own host path),
// and the empty mount points runtimes expect.
func buildRootfs(ctx context.Context, dir string) error {
	out, err := exec.CommandContext(ctx, busyboxPath, "--list").Output()
	if err != nil {
		return fmt.Errorf("list applets of %s (install busybox-static): %w", busyboxPath, err)
	}
	for _, d := range []string{"bin", "proc", "dev", "sys", "tmp", "etc", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return fmt.Errorf("rootfs dir %s: %w", d, err)
		}
	}
	if err := os.Chmod(filepath.Join(dir, "tmp"), 0o1777); err != nil {
		return fmt.Errorf("rootfs /tmp: %w", err)
	}
	bb, err := os.ReadFile(busyboxPath)
	if err != nil {
		return fmt.Errorf("read busybox: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "busybox"), bb, 0o755); err != nil {
		return fmt.Errorf("write rootfs busybox: %w", err)
	}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "busybox" {
			continue
		}
		link := filepath.Join(dir, "bin", applet)
		if err := os.Symlink("busybox", link); err != nil {
			return fmt.Errorf("applet link %s: %w", applet, err)
		}
	}
	files := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
		"etc/group":    "root:x:0:\nnogroup:x:65534:\n",
		"etc/hostname": "sandbox\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return fmt.Errorf("rootfs %s: %w", name, err)
		}
	}
	for _, must := range []string{"bin/true", "bin/sh", "bin/sleep"} {
		if _, err := os.Stat(filepath.Join(dir, must)); err != nil {
			return fmt.Errorf("rootfs lacks /%s: %w", must, err)
		}
	}
	return nil
}

// buildEROFS packs dir into an EROFS image at img for systems that take
// layers. mkfs.erofs 1.5 is enough for a plain directory.
func buildEROFS(ctx context.Context, dir, img string) error {
	out, err := exec.CommandContext(ctx, "mkfs.erofs", img, dir).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mkfs.erofs %s: %w: %s", img, err, strings.TrimSpace(string(out)))
	}
	return nil
}
