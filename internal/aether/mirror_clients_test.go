package aether

import (
	"archive/tar"
	"archive/zip"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The real package managers against the mirror, through the proxy, with
// the variables MirrorEnv gives (skipped where pip or npm is missing).

func wheelBytes(t *testing.T) []byte {
	var buf bytes.Buffer
	z := zip.NewWriter(&buf)
	files := map[string]string{
		"demo/__init__.py":                 "VALUE = 42\n",
		"demo-1.0.dist-info/METADATA":      "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
		"demo-1.0.dist-info/WHEEL":         "Wheel-Version: 1.0\nGenerator: dsec-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
		"demo-1.0.dist-info/top_level.txt": "demo\n",
	}
	var record strings.Builder
	for _, name := range []string{"demo/__init__.py", "demo-1.0.dist-info/METADATA", "demo-1.0.dist-info/WHEEL", "demo-1.0.dist-info/top_level.txt"} {
		w, _ := z.Create(name)
		w.Write([]byte(files[name]))
		sum := sha256.Sum256([]byte(files[name]))
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", name, base64.RawURLEncoding.EncodeToString(sum[:]), len(files[name]))
	}
	record.WriteString("demo-1.0.dist-info/RECORD,,\n")
	w, _ := z.Create("demo-1.0.dist-info/RECORD")
	w.Write([]byte(record.String()))
	if err := z.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func clientEnv(h *mirrorHarness, p Policy) []string {
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + h.t.TempDir(),
		"http_proxy=http://" + h.proxy, "HTTP_PROXY=http://" + h.proxy, "no_proxy=", "NO_PROXY="}
	return append(env, MirrorEnv(p)...)
}

func TestMirrorPip(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil || exec.Command(py, "-m", "pip", "--version").Run() != nil {
		t.Skip("no python3 -m pip here")
	}
	up := newUpstream(t)
	whl := wheelBytes(t)
	up.files["/packages/aa/demo-1.0-py3-none-any.whl"] = whl
	up.pages["/simple/demo/"] = fmt.Sprintf(`<!DOCTYPE html><html><body><a href="%s/packages/aa/demo-1.0-py3-none-any.whl#sha256=%s">demo-1.0-py3-none-any.whl</a></body></html>`,
		up.url("files.pythonhosted.org"), hexSHA256(whl))
	pol := mustPolicy(t, []string{"pypi"}, nil)
	h := newMirrorHarness(t, up, pol)
	for i := 0; i < 2; i++ {
		target := t.TempDir()
		cmd := exec.Command(py, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--no-deps", "--target", target, "demo")
		cmd.Env = clientEnv(h, pol)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("pip install through the mirror: %v\n%s", err, out)
		}
		if b, err := os.ReadFile(filepath.Join(target, "demo", "__init__.py")); err != nil || string(b) != "VALUE = 42\n" {
			t.Fatalf("installed: %q %v", b, err)
		}
	}
	if n := up.hitsOf("/packages/aa/demo-1.0-py3-none-any.whl"); n != 1 {
		t.Fatalf("upstream served the wheel %d times for two installs", n)
	}
}

func TestMirrorNpmClient(t *testing.T) {
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("no npm here")
	}
	var tgz bytes.Buffer
	gz := gzip.NewWriter(&tgz)
	tw := tar.NewWriter(gz)
	for name, body := range map[string]string{
		"package/package.json": `{"name":"demo","version":"1.0.0","main":"index.js"}`,
		"package/index.js":     "module.exports = 42;\n",
	} {
		tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
		tw.Write([]byte(body))
	}
	tw.Close()
	gz.Close()
	up := newUpstream(t)
	sum := sha512.Sum512(tgz.Bytes())
	up.files["/demo/-/demo-1.0.0.tgz"] = tgz.Bytes()
	up.pages["/demo"] = fmt.Sprintf(`{"name":"demo","dist-tags":{"latest":"1.0.0"},"versions":{"1.0.0":{"name":"demo","version":"1.0.0","dist":{"tarball":"%s/demo/-/demo-1.0.0.tgz","integrity":"sha512-%s"}}}}`,
		up.url("registry.npmjs.org"), base64.StdEncoding.EncodeToString(sum[:]))
	pol := mustPolicy(t, []string{"npm"}, nil)
	h := newMirrorHarness(t, up, pol)
	for i := 0; i < 2; i++ {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, "package.json"), []byte(`{"name":"app","version":"1.0.0"}`), 0o644)
		cmd := exec.Command(npm, "install", "--no-audit", "--no-fund", "--cache", filepath.Join(dir, ".cache"), "demo")
		cmd.Dir = dir
		cmd.Env = clientEnv(h, pol)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("npm install through the mirror: %v\n%s", err, out)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "node_modules", "demo", "index.js")); err != nil || string(b) != "module.exports = 42;\n" {
			t.Fatalf("installed: %q %v", b, err)
		}
	}
	if n := up.hitsOf("/demo/-/demo-1.0.0.tgz"); n != 1 {
		t.Fatalf("upstream served the tarball %d times for two installs", n)
	}
}
