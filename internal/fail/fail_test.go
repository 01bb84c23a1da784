package fail_test

import (
	"errors"
	"fmt"
	"io/fs"
	"testing"

	"github.com/dsec-dev/dsec/internal/fail"
)

func TestKinds(t *testing.T) {
	cause := fmt.Errorf("sandbox %q: %w", "x", fs.ErrNotExist)
	err := fmt.Errorf("outer: %w", fail.New(fail.NotFound, cause))
	if fail.KindOf(err) != fail.NotFound || !fail.Is(err, fail.NotFound) {
		t.Fatalf("kind of a wrapped error: %v", fail.KindOf(err))
	}
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("the cause is not reachable through the kind")
	}
	if err.Error() != `outer: sandbox "x": file does not exist` {
		t.Fatalf("the kind changed the message: %q", err)
	}
	if fail.New(fail.Internal, nil) != nil {
		t.Fatal("New of nil is not nil")
	}
	if fail.KindOf(errors.New("plain")) != fail.Unknown || fail.Is(nil, fail.Unknown) {
		t.Fatal("an unclassified error has a kind")
	}
	// The outermost kind wins: a caller reclassifies what it wraps.
	inner := fail.Errorf(fail.Unavailable, "store down")
	if k := fail.KindOf(fail.New(fail.Internal, inner)); k != fail.Internal {
		t.Fatalf("outer kind %v, want internal", k)
	}
	if e := fail.Invalid("spec.backend %q is not offered", "vm"); fail.KindOf(e) != fail.InvalidArgument || e.Error() != `spec.backend "vm" is not offered` {
		t.Fatalf("Invalid: %v %q", fail.KindOf(e), e)
	}
	for k := fail.Unknown; k <= fail.Unauthenticated; k++ {
		if fail.ParseKind(k.String()) != k {
			t.Errorf("kind %d (%s) does not parse back", k, k)
		}
	}
	if fail.ParseKind("bogus") != fail.Unknown {
		t.Fatal("a bogus name parsed")
	}
}
