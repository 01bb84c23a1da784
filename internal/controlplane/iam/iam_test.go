package iam

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/spec"
)

func newStore(t *testing.T) *blobstore.Dir {
	t.Helper()
	d, err := blobstore.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestValidateName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"alice", true},
		{"team-7", true},
		{"a", true},
		{strings.Repeat("a", 63), true},
		{strings.Repeat("a", 64), false},
		{"", false},
		{"Alice", false},
		{"-a", false},
		{"a-", false},
		{"a.b", false},
		{"a_b", false},
		{"a/b", false},
		{AdminTenant, false},
		{AnonymousTenant, false},
	} {
		err := ValidateName(tc.name)
		if (err == nil) != tc.ok {
			t.Errorf("ValidateName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("ValidateName(%q) error %v does not wrap ErrInvalid", tc.name, err)
		}
	}
}

func TestQuotaAdmit(t *testing.T) {
	one := Usage{Sandboxes: 1, MilliCPU: 500, MemoryBytes: 1 << 20}
	for _, tc := range []struct {
		name      string
		q         Quota
		inUse     Usage
		wantQuota string // "" = admitted
	}{
		{"unlimited", Quota{}, Usage{Sandboxes: 1e6, MilliCPU: 1e9, MemoryBytes: 1 << 50}, ""},
		{"room left", Quota{MaxSandboxes: 2}, Usage{Sandboxes: 1}, ""},
		{"exactly full after", Quota{MaxSandboxes: 2, MaxMilliCPU: 1000}, Usage{Sandboxes: 1, MilliCPU: 500}, ""},
		{"sandboxes full", Quota{MaxSandboxes: 1}, Usage{Sandboxes: 1}, "max_sandboxes"},
		{"cpu over", Quota{MaxMilliCPU: 1000}, Usage{MilliCPU: 600}, "max_milli_cpu"},
		{"memory over", Quota{MaxMemoryBytes: 1 << 20}, Usage{MemoryBytes: 1}, "max_memory_bytes"},
		{"sandboxes reported first", Quota{MaxSandboxes: 1, MaxMilliCPU: 1}, Usage{Sandboxes: 1, MilliCPU: 1}, "max_sandboxes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.q.Admit("alice", tc.inUse, one)
			if tc.wantQuota == "" {
				if err != nil {
					t.Fatalf("Admit = %v, want admitted", err)
				}
				return
			}
			var qe *QuotaError
			if !errors.As(err, &qe) || !errors.Is(err, ErrQuota) {
				t.Fatalf("Admit = %v, want a *QuotaError", err)
			}
			if qe.Quota != tc.wantQuota || !strings.Contains(err.Error(), tc.wantQuota) || !strings.Contains(err.Error(), `"alice"`) {
				t.Fatalf("Admit error %q names %q, want %q and the tenant", err, qe.Quota, tc.wantQuota)
			}
		})
	}
}

func TestQuotaValidate(t *testing.T) {
	for _, tc := range []struct {
		q     Quota
		field string
	}{
		{Quota{MaxSandboxes: -1}, "max_sandboxes"},
		{Quota{MaxMilliCPU: -1}, "max_milli_cpu"},
		{Quota{MaxMemoryBytes: -1}, "max_memory_bytes"},
	} {
		err := tc.q.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tc.q, err, tc.field)
		}
	}
	if err := (Quota{MaxSandboxes: 3}).Validate(); err != nil {
		t.Errorf("Validate of a good quota: %v", err)
	}
}

func TestBearerToken(t *testing.T) {
	for _, tc := range []struct {
		header, want string
		ok           bool
	}{
		{"Bearer abc", "abc", true},
		{"bearer abc", "abc", true},
		{"Bearer  abc ", "abc", true},
		{"Basic abc", "", false},
		{"Bearer", "", false},
		{"Bearer ", "", false},
		{"", "", false},
	} {
		got, ok := BearerToken(tc.header)
		if got != tc.want || ok != tc.ok {
			t.Errorf("BearerToken(%q) = %q, %v; want %q, %v", tc.header, got, ok, tc.want, tc.ok)
		}
	}
}

func TestAuthenticate(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	a, err := New("admin-secret", store)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := a.CreateTenant(ctx, "alice", Quota{MaxSandboxes: 5}, spec.Resources{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tok, "alice.") {
		t.Fatalf("token %q does not name its tenant", tok)
	}
	_, secret, _ := strings.Cut(tok, ".")
	for _, tc := range []struct {
		name, token string
		want        Principal
		err         error
	}{
		{"admin", "admin-secret", Principal{Tenant: AdminTenant, Admin: true}, nil},
		{"tenant", tok, Principal{Tenant: "alice"}, nil},
		{"empty", "", Principal{}, ErrUnauthenticated},
		{"wrong secret", "alice." + strings.Repeat("0", len(secret)), Principal{}, ErrUnauthenticated},
		{"unknown tenant", "bob." + secret, Principal{}, ErrUnauthenticated},
		{"secret under another name", "admin." + secret, Principal{}, ErrUnauthenticated},
		{"no dot", secret, Principal{}, ErrUnauthenticated},
		{"bad name", "../x." + secret, Principal{}, ErrUnauthenticated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := a.Authenticate(ctx, tc.token)
			if !errors.Is(err, tc.err) || p != tc.want {
				t.Fatalf("Authenticate(%q) = %+v, %v; want %+v, %v", tc.token, p, err, tc.want, tc.err)
			}
		})
	}

	// Another replica over the same store knows the tenant without being
	// told, and never sees the token itself in the store.
	b, err := New("admin-secret", store)
	if err != nil {
		t.Fatal(err)
	}
	if p, err := b.Authenticate(ctx, tok); err != nil || p.Tenant != "alice" {
		t.Fatalf("second replica: Authenticate = %+v, %v", p, err)
	}
	tenant, err := b.Tenant(ctx, "alice")
	if err != nil || tenant.Quota.MaxSandboxes != 5 {
		t.Fatalf("second replica: Tenant = %+v, %v", tenant, err)
	}
	err = store.Walk(ctx, func(d blobstore.Descriptor) error {
		blob, err := blobstore.ReadAll(ctx, store, d.Digest)
		if err == nil && strings.Contains(string(blob), secret) {
			t.Errorf("blob %s holds the token secret", d.Digest)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestCreateTenantErrors(t *testing.T) {
	ctx := context.Background()
	a, err := New("x", newStore(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.CreateTenant(ctx, "alice", Quota{}, spec.Resources{}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		q    Quota
		err  error
	}{
		{"alice", Quota{}, ErrExists},
		{"admin", Quota{}, ErrInvalid},
		{"Bad", Quota{}, ErrInvalid},
		{"bob", Quota{MaxMilliCPU: -5}, ErrInvalid},
	} {
		if _, err := a.CreateTenant(ctx, tc.name, tc.q, spec.Resources{}); !errors.Is(err, tc.err) {
			t.Errorf("CreateTenant(%q, %+v) = %v, want %v", tc.name, tc.q, err, tc.err)
		}
	}
}

func TestTenantCacheExpires(t *testing.T) {
	ctx := context.Background()
	store := newStore(t)
	a, _ := New("x", store)
	now := time.Unix(1000, 0)
	a.now = func() time.Time { return now }
	if _, err := a.CreateTenant(ctx, "alice", Quota{MaxSandboxes: 1}, spec.Resources{}); err != nil {
		t.Fatal(err)
	}
	// Another replica rewrites the record (as a future quota update would).
	b, _ := New("x", store)
	if err := store.Refs().Delete(ctx, "tenants/alice"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.CreateTenant(ctx, "alice", Quota{MaxSandboxes: 9}, spec.Resources{}); err != nil {
		t.Fatal(err)
	}
	if got, _ := a.Tenant(ctx, "alice"); got.Quota.MaxSandboxes != 1 {
		t.Fatalf("cached quota = %d, want 1 within the TTL", got.Quota.MaxSandboxes)
	}
	now = now.Add(DefaultCacheTTL + time.Second)
	if got, _ := a.Tenant(ctx, "alice"); got.Quota.MaxSandboxes != 9 {
		t.Fatalf("quota after TTL = %d, want 9", got.Quota.MaxSandboxes)
	}
}

func TestEnsureTokenFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", AdminTokenFile)
	const n = 8
	toks := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { toks[i], errs[i] = EnsureTokenFile(path) })
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if toks[i] != toks[0] || len(toks[0]) != 64 {
			t.Fatalf("racing creators got different or short tokens: %q vs %q", toks[i], toks[0])
		}
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("token file mode %v, want 0600", st.Mode().Perm())
	}
	again, err := EnsureTokenFile(path)
	if err != nil || again != toks[0] {
		t.Fatalf("second start read %q, %v; want the same token", again, err)
	}
	left, _ := filepath.Glob(filepath.Join(dir, "sub", ".token-*"))
	if len(left) != 0 {
		t.Fatalf("temp files left behind: %v", left)
	}
	empty := filepath.Join(dir, "empty")
	os.WriteFile(empty, nil, 0o600)
	if _, err := EnsureTokenFile(empty); err == nil {
		t.Fatal("an empty token file was accepted")
	}
}
