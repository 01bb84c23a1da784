package controlplane

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"

	"github.com/dsec-dev/dsec/internal/controlplane/iam"
	"github.com/dsec-dev/dsec/internal/image"
	"github.com/dsec-dev/dsec/internal/placement"
)

func TestImageNamespaces(t *testing.T) {
	for _, tc := range []struct {
		internal, owner, user string
	}{
		{"busybox:1", "", "busybox:1"},
		{"t/alice/mine:1", "alice", "mine:1"},
		{"t/alice/deep/name:2", "alice", "deep/name:2"},
		{"t/bob/x:1", "bob", "x:1"},
		{"tools/t/x:1", "", "tools/t/x:1"},
	} {
		if got := ownerOf(tc.internal); got != tc.owner {
			t.Errorf("ownerOf(%q) = %q, want %q", tc.internal, got, tc.owner)
		}
		if got := userRef(tc.internal, tc.owner); got != tc.user {
			t.Errorf("userRef(%q, %q) = %q, want %q", tc.internal, tc.owner, got, tc.user)
		}
	}
	// Another tenant's prefix is never stripped: the name stays internal.
	if got := userRef("t/bob/x:1", "alice"); got != "t/bob/x:1" {
		t.Errorf("userRef across tenants = %q", got)
	}
}

func TestCheckUserRef(t *testing.T) {
	alice := iam.Principal{Tenant: "alice"}
	admin := iam.Principal{Tenant: iam.AdminTenant, Admin: true}
	for _, tc := range []struct {
		p    iam.Principal
		ref  string
		code connect.Code // 0 = accepted
	}{
		{alice, "busybox", 0},
		{alice, "busybox:1", 0},
		{alice, "", connect.CodeInvalidArgument},
		{alice, "Busybox:1", connect.CodeInvalidArgument},
		{alice, "t/bob/x:1", connect.CodeInvalidArgument},
		{admin, "t/bob/x:1", 0},
	} {
		_, err := checkUserRef(tc.p, "spec.image", tc.ref)
		if connect.CodeOf(err) != tc.code && !(tc.code == 0 && err == nil) {
			t.Errorf("checkUserRef(%v, %q) = %v, want code %v", tc.p, tc.ref, err, tc.code)
		}
	}
}

func TestVisible(t *testing.T) {
	for _, tc := range []struct {
		p     iam.Principal
		owner string
		want  bool
	}{
		{iam.Principal{Tenant: "alice"}, "alice", true},
		{iam.Principal{Tenant: "alice"}, "bob", false},
		{iam.Principal{Tenant: "alice"}, "", false},
		{iam.Principal{Tenant: iam.AdminTenant, Admin: true}, "bob", true},
	} {
		if got := visible(tc.p, tc.owner); got != tc.want {
			t.Errorf("visible(%v, %q) = %v, want %v", tc.p, tc.owner, got, tc.want)
		}
	}
}

func TestToConnect(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code connect.Code
	}{
		{&iam.QuotaError{Tenant: "a", Quota: "max_sandboxes"}, connect.CodeResourceExhausted},
		{&placement.CapacityError{Kind: "container"}, connect.CodeResourceExhausted},
		{fmt.Errorf("resolve: %w", image.ErrNotFound), connect.CodeNotFound},
		{fmt.Errorf("x: %w", image.ErrInvalidRef), connect.CodeInvalidArgument},
		{fmt.Errorf("x: %w", iam.ErrExists), connect.CodeAlreadyExists},
		{fmt.Errorf("x: %w", iam.ErrInvalid), connect.CodeInvalidArgument},
		{context.DeadlineExceeded, connect.CodeDeadlineExceeded},
		{connect.NewError(connect.CodePermissionDenied, errors.New("kept")), connect.CodePermissionDenied},
		{errors.New("other"), connect.CodeInternal},
	} {
		if got := connect.CodeOf(toConnect(tc.err)); got != tc.code {
			t.Errorf("toConnect(%v) code %v, want %v", tc.err, got, tc.code)
		}
	}
	ie := (&Server{}).itemError(&iam.QuotaError{Tenant: "a", Quota: "max_sandboxes", Limit: 1})
	if ie.GetCode() != "resource_exhausted" || ie.GetMessage() == "" {
		t.Errorf("itemError = %v", ie)
	}
}

func TestRetryable(t *testing.T) {
	for code, want := range map[connect.Code]bool{
		connect.CodeResourceExhausted: true,
		connect.CodeUnavailable:       true,
		connect.CodeNotFound:          false,
		connect.CodeInvalidArgument:   false,
		connect.CodeInternal:          false,
	} {
		if got := retryable(connect.NewError(code, errors.New("x"))); got != want {
			t.Errorf("retryable(%v) = %v, want %v", code, got, want)
		}
	}
}
