package redact

import (
	"errors"
	"testing"

	"connectrpc.com/connect"
)

func TestString(t *testing.T) {
	r := New(nil, "/var/lib/dsec", "/var/lib/dsec/blobs", "relative", "/", "")
	for _, tc := range []struct{ in, want string }{
		{"open /var/lib/dsec/blobs/tmp/upload-1: no such file", "open <server path>: no such file"},
		{`extract into "/var/lib/dsec/x y": bad`, `extract into "<server path> y": bad`},
		{"/var/lib/dsec", "<server path>"},
		{"/var/lib/dsecond/x and /var/lib/dsec/a,/var/lib/dsec/b", "/var/lib/dsecond/x and <server path>,<server path>"},
		{"read /etc/passwd in sandbox: not found", "read /etc/passwd in sandbox: not found"},
		{"relative/x", "relative/x"},
	} {
		if got := r.String(tc.in); got != tc.want {
			t.Errorf("String(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestError(t *testing.T) {
	r := New(nil, "/data")
	in := connect.NewError(connect.CodeNotFound, errors.New("open /data/refs/x: no such file"))
	in.Meta().Set("Retry-After", "3")
	err := r.Error(in)
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound || ce.Message() != "open <server path>: no such file" || ce.Meta().Get("Retry-After") != "3" {
		t.Fatalf("Error = %v (meta %v)", err, ce.Meta())
	}
	plain := errors.New("nothing to hide")
	if r.Error(plain) != plain || r.Error(nil) != nil {
		t.Error("an error without host paths is changed")
	}
}
