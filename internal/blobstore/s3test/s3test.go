// Package s3test runs a real S3-compatible server for tests: SeaweedFS's
// `weed mini` (master, volume server, filer and S3 gateway in one process),
// built by scripts/seaweedfs.sh, on loopback with free ports and a temp
// directory, with one bucket and credentials. Tests that need it skip with
// the reason when the binary is absent, unless CI is set: CI must run them,
// so there they fail.
package s3test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// DefaultBinary is where scripts/seaweedfs.sh puts weed.
const DefaultBinary = "/var/cache/dsec/bin/weed"

// startTimeout bounds how long the server may take to answer S3 requests.
// It starts in a few seconds; the bound is for a machine whose two cores
// are busy with other tests.
const startTimeout = 2 * time.Minute

// Server is a running S3 server.
type Server struct {
	// Endpoint is http://127.0.0.1:PORT.
	Endpoint string
	// Bucket exists and is empty when Start returns.
	Bucket               string
	AccessKey, SecretKey string
	// Dir is the server's data directory (removed when the test ends).
	Dir string

	cmd  *exec.Cmd
	log  *bytes.Buffer
	done chan struct{}
}

// Binary returns the weed binary to run: $DSEC_WEED, else DefaultBinary,
// else weed on PATH; "" when there is none.
func Binary() string {
	if p := os.Getenv("DSEC_WEED"); p != "" {
		return p
	}
	if _, err := os.Stat(DefaultBinary); err == nil {
		return DefaultBinary
	}
	if p, err := exec.LookPath("weed"); err == nil {
		return p
	}
	return ""
}

// Need returns the weed binary, skipping the test when there is none (or
// failing it under CI=true, where it must have been built).
func Need(t testing.TB) string {
	t.Helper()
	bin := Binary()
	if bin != "" {
		return bin
	}
	msg := "no SeaweedFS weed binary (run scripts/seaweedfs.sh, which builds it into " + filepath.Dir(DefaultBinary) + ", or set DSEC_WEED)"
	if os.Getenv("CI") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// Start starts a server for t and stops it, removing its data, when t
// ends.
func Start(t testing.TB) *Server {
	t.Helper()
	bin := Need(t)
	s, err := start(bin, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// StartIn starts a server with its data in dir, for a server shared by
// several tests (TestMain or a sync.Once); the caller stops it. Call Need
// first, so that a missing binary skips.
func StartIn(dir string) (*Server, error) {
	bin := Binary()
	if bin == "" {
		return nil, errors.New("s3test: no weed binary (scripts/seaweedfs.sh builds it)")
	}
	return start(bin, dir)
}

// freePorts returns n distinct free TCP ports on loopback. They are free
// when returned; the server binds them a moment later.
func freePorts(n int) ([]int, error) {
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	ports := make([]int, 0, n)
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func start(bin, dir string) (*Server, error) {
	ports, err := freePorts(10)
	if err != nil {
		return nil, fmt.Errorf("s3test: free ports: %w", err)
	}
	p := func(i int) string { return strconv.Itoa(ports[i]) }
	s := &Server{
		Endpoint:  "http://127.0.0.1:" + p(6),
		Bucket:    "dsec-test",
		AccessKey: "dsectest" + randomHex(4),
		SecretKey: randomHex(20),
		Dir:       dir,
		log:       &bytes.Buffer{},
		done:      make(chan struct{}),
	}
	data := filepath.Join(dir, "data")
	if err := os.MkdirAll(data, 0o755); err != nil {
		return nil, err
	}
	s.cmd = exec.Command(bin, "mini",
		"-dir="+data,
		"-ip=127.0.0.1", "-ip.bind=127.0.0.1",
		"-master.port="+p(0), "-master.port.grpc="+p(1),
		"-volume.port="+p(2), "-volume.port.grpc="+p(3),
		"-filer.port="+p(4), "-filer.port.grpc="+p(5),
		"-s3.port="+p(6), "-s3.port.grpc="+p(7),
		// The admin server runs whatever -admin.ui says; on ports of its
		// own, so that two servers (tests of two packages) do not meet on
		// its default ones.
		"-admin.port="+p(8), "-admin.port.grpc="+p(9),
		"-filer.localSocket="+filepath.Join(dir, "filer.sock"),
		"-s3.localSocket="+filepath.Join(dir, "s3.sock"),
		// Nothing but the S3 gateway and what it needs; nothing that
		// reaches the network (telemetry) or binds fixed ports.
		"-webdav=false", "-admin.ui=false", "-admin.port.legacy=0",
		"-s3.port.iceberg=0", "-s3.port.lance=0",
		"-master.telemetry=false",
	)
	// weed registers an admin identity from these: requests must be
	// signed with them, as against a real deployment.
	s.cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID="+s.AccessKey, "AWS_SECRET_ACCESS_KEY="+s.SecretKey)
	s.cmd.Dir = dir
	s.cmd.Stdout = &syncWriter{w: s.log}
	s.cmd.Stderr = s.cmd.Stdout
	// Its own process group, so that Stop reaches anything it starts.
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("s3test: start %s: %w", bin, err)
	}
	go func() {
		s.cmd.Wait()
		close(s.done)
	}()
	if err := s.waitReady(); err != nil {
		s.Stop()
		return nil, fmt.Errorf("s3test: %w\nweed output:\n%s", err, s.Log())
	}
	return s, nil
}

// Client returns a client of the server signed with its credentials.
func (s *Server) Client() (*minio.Client, error) {
	return minio.New(s.Endpoint[len("http://"):], &minio.Options{
		Creds:  credentials.NewStaticV4(s.AccessKey, s.SecretKey, ""),
		Region: "us-east-1",
	})
}

// waitReady polls until the server creates the bucket: that needs the S3
// gateway, the filer behind it and the master, so it answers only when
// all of them are up.
func (s *Server) waitReady() error {
	c, err := s.Client()
	if err != nil {
		return err
	}
	deadline := time.Now().Add(startTimeout)
	var last error
	for delay := 50 * time.Millisecond; ; delay = min(delay*2, time.Second) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		last = c.MakeBucket(ctx, s.Bucket, minio.MakeBucketOptions{})
		if last != nil {
			if code := minio.ToErrorResponse(last).Code; code == "BucketAlreadyOwnedByYou" || code == "BucketAlreadyExists" {
				last = nil
			}
		}
		if last == nil {
			// Created; a put must work too (the volume server may still be
			// registering with the master).
			_, last = c.PutObject(ctx, s.Bucket, ".ready", bytes.NewReader([]byte("ok")), 2, minio.PutObjectOptions{})
			if last == nil {
				last = c.RemoveObject(ctx, s.Bucket, ".ready", minio.RemoveObjectOptions{})
			}
		}
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-s.done:
			return fmt.Errorf("weed exited before it served S3 (%v)", s.cmd.ProcessState)
		case <-time.After(delay):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("weed did not serve S3 within %v: %w", startTimeout, last)
		}
	}
}

// Stop kills the server (and its process group) and waits for it.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	select {
	case <-s.done:
		return
	default:
	}
	syscall.Kill(-s.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		// It had its chance to shut down cleanly.
		syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
	}
}

// Log returns what the server printed so far.
func (s *Server) Log() string {
	w := s.cmd.Stdout.(*syncWriter)
	w.mu.Lock()
	defer w.mu.Unlock()
	return s.log.String()
}

// Env returns the environment a dsec daemon needs to reach the server:
// the credentials, as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.
func (s *Server) Env() []string {
	return []string{"AWS_ACCESS_KEY_ID=" + s.AccessKey, "AWS_SECRET_ACCESS_KEY=" + s.SecretKey}
}

// NewPrefix returns a prefix no other caller got, so that tests sharing
// one server and bucket each see an empty store.
func NewPrefix() string { return "t-" + randomHex(6) }

type syncWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.w.Len() > 1<<20 {
		// Keep the start, which says why it failed to come up.
		return len(p), nil
	}
	return w.w.Write(p)
}
