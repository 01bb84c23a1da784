// Package iam decides who is calling the DSec API and what they may use:
// bearer tokens map to the admin or to a tenant, and tenants carry quotas.
//
// Tenants live in the blob store (ref "tenants/<name>" pointing at a JSON
// record), not in a server's memory, so every control-plane replica sees a
// tenant created on any other one. Only the sha256 of a token is stored: a
// copy of the blob store does not leak credentials.
//
// A tenant token is "<tenant>.<secret>", so authenticating an unknown token
// costs one ref lookup instead of a scan of every tenant.
package iam

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/dsec-dev/dsec/internal/blobstore"
	"github.com/dsec-dev/dsec/internal/spec"
)

// AdminTenant is the tenant name recorded on objects the admin creates. It is
// reserved: no tenant may take it.
const AdminTenant = "admin"

// AnonymousTenant is the identity of tokenless /run_code callers from the
// networks the server opens it to. It is reserved too: a tenant of that
// name would share its private images with them.
const AnonymousTenant = "anonymous"

// AdminTokenFile is the admin token's file name inside the data directory.
const AdminTokenFile = "admin.token"

const refPrefix = "tenants/"

// Errors callers map to API codes with errors.Is.
var (
	// ErrUnauthenticated: no token, or one that matches nobody.
	ErrUnauthenticated = errors.New("missing or invalid bearer token")
	// ErrInvalid wraps a bad tenant name or quota (the message names the field).
	ErrInvalid = errors.New("invalid tenant")
	// ErrExists: a tenant of that name already exists.
	ErrExists = errors.New("tenant already exists")
	// ErrQuota is matched by every *QuotaError.
	ErrQuota = errors.New("quota exceeded")
)

// Principal is an authenticated caller.
type Principal struct {
	Tenant string
	Admin  bool
}

// Quota bounds what one tenant's live sandboxes and pools may hold at
// once; a zero field is unlimited. MaxImportBytes bounds one image import
// after decompression; zero takes the server's default.
type Quota struct {
	MaxSandboxes   int64 `json:"maxSandboxes,omitempty"`
	MaxMilliCPU    int64 `json:"maxMilliCpu,omitempty"`
	MaxMemoryBytes int64 `json:"maxMemoryBytes,omitempty"`
	MaxImportBytes int64 `json:"maxImportBytes,omitempty"`
}

// Usage is what a tenant's sandboxes hold (or what one more would add).
type Usage struct {
	Sandboxes   int64
	MilliCPU    int64
	MemoryBytes int64
}

// Add returns u + v.
func (u Usage) Add(v Usage) Usage {
	return Usage{u.Sandboxes + v.Sandboxes, u.MilliCPU + v.MilliCPU, u.MemoryBytes + v.MemoryBytes}
}

// Sub returns u - v.
func (u Usage) Sub(v Usage) Usage {
	return Usage{u.Sandboxes - v.Sandboxes, u.MilliCPU - v.MilliCPU, u.MemoryBytes - v.MemoryBytes}
}

// QuotaError names the quota a request would overrun.
type QuotaError struct {
	Tenant string
	// Quota is the field name as in the API: max_sandboxes, max_milli_cpu
	// or max_memory_bytes.
	Quota        string
	Limit, InUse int64
	Need         int64
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("tenant %q quota %s exceeded: %d in use, %d requested, limit %d", e.Tenant, e.Quota, e.InUse, e.Need, e.Limit)
}

// Unwrap makes errors.Is(err, ErrQuota) hold.
func (e *QuotaError) Unwrap() error { return ErrQuota }

// Admit reports whether adding need to inUse stays within q, and if not which
// quota it overruns (sandboxes first, then CPU, then memory).
func (q Quota) Admit(tenant string, inUse, need Usage) error {
	check := func(name string, limit, used, n int64) error {
		if limit > 0 && used+n > limit {
			return &QuotaError{Tenant: tenant, Quota: name, Limit: limit, InUse: used, Need: n}
		}
		return nil
	}
	if err := check("max_sandboxes", q.MaxSandboxes, inUse.Sandboxes, need.Sandboxes); err != nil {
		return err
	}
	if err := check("max_milli_cpu", q.MaxMilliCPU, inUse.MilliCPU, need.MilliCPU); err != nil {
		return err
	}
	return check("max_memory_bytes", q.MaxMemoryBytes, inUse.MemoryBytes, need.MemoryBytes)
}

// Validate rejects negative limits.
func (q Quota) Validate() error {
	switch {
	case q.MaxSandboxes < 0:
		return fmt.Errorf("%w: quota.max_sandboxes %d is negative", ErrInvalid, q.MaxSandboxes)
	case q.MaxMilliCPU < 0:
		return fmt.Errorf("%w: quota.max_milli_cpu %d is negative", ErrInvalid, q.MaxMilliCPU)
	case q.MaxMemoryBytes < 0:
		return fmt.Errorf("%w: quota.max_memory_bytes %d is negative", ErrInvalid, q.MaxMemoryBytes)
	case q.MaxImportBytes < 0:
		return fmt.Errorf("%w: quota.max_import_bytes %d is negative", ErrInvalid, q.MaxImportBytes)
	}
	return nil
}

// Scale returns u for n of the same sandbox (a pool's size).
func (u Usage) Scale(n int64) Usage {
	return Usage{u.Sandboxes * n, u.MilliCPU * n, u.MemoryBytes * n}
}

// validName: 1-63 of [a-z0-9-], not starting or ending with '-' (written
// out: a regexp with counted repetition costs every process start here).
func validName(name string) bool {
	if len(name) == 0 || len(name) > 63 || name[0] == '-' || name[len(name)-1] == '-' {
		return false
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// ValidateName checks a tenant name: 1-63 characters of [a-z0-9-], not
// starting or ending with '-', and neither "admin" nor "anonymous". The name becomes a path
// component of image refs ("t/<tenant>/..."), so it must also be a valid
// image name component, which this pattern guarantees.
func ValidateName(name string) error {
	if !validName(name) {
		return fmt.Errorf("%w: name %q must be 1-63 characters of [a-z0-9-], starting and ending with a letter or digit", ErrInvalid, name)
	}
	if name == AdminTenant || name == AnonymousTenant {
		return fmt.Errorf("%w: name %q is reserved", ErrInvalid, name)
	}
	return nil
}

// Tenant is the durable record of one tenant.
type Tenant struct {
	Name string `json:"name"`
	// TokenSHA256 is the hex sha256 of the tenant's bearer token.
	TokenSHA256 string `json:"tokenSha256"`
	Quota       Quota  `json:"quota"`
	// Defaults are what the tenant's sandboxes get for resources their
	// spec leaves 0; a zero field takes the node's default.
	Defaults spec.Resources `json:"defaults,omitzero"`
	Created  time.Time      `json:"created"`
}

// DefaultCacheTTL bounds how long a replica trusts its cached copy of a
// tenant record before reading it again from the blob store.
const DefaultCacheTTL = 30 * time.Second

// IAM authenticates tokens and keeps tenants. It is safe for concurrent use.
type IAM struct {
	adminHash [sha256.Size]byte
	blobs     blobstore.Store
	refs      blobstore.Refs
	ttl       time.Duration
	now       func() time.Time

	mu    sync.Mutex
	cache map[string]cached
}

type cached struct {
	t      Tenant
	hash   [sha256.Size]byte
	loaded time.Time
}

// New returns an IAM whose all-powerful token is adminToken, keeping
// tenants in repo.
func New(adminToken string, repo blobstore.Repository) (*IAM, error) {
	if adminToken == "" {
		return nil, errors.New("iam: admin token is empty")
	}
	if repo == nil {
		return nil, errors.New("iam: blob store is nil")
	}
	return &IAM{
		adminHash: sha256.Sum256([]byte(adminToken)),
		blobs:     repo,
		refs:      repo.Refs(),
		ttl:       DefaultCacheTTL,
		now:       time.Now,
		cache:     map[string]cached{},
	}, nil
}

// Authenticate maps a bearer token to its principal, or ErrUnauthenticated.
func (a *IAM) Authenticate(ctx context.Context, token string) (Principal, error) {
	if token == "" {
		return Principal{}, ErrUnauthenticated
	}
	h := sha256.Sum256([]byte(token))
	if subtle.ConstantTimeCompare(h[:], a.adminHash[:]) == 1 {
		return Principal{Tenant: AdminTenant, Admin: true}, nil
	}
	name, _, ok := strings.Cut(token, ".")
	if !ok || ValidateName(name) != nil {
		return Principal{}, ErrUnauthenticated
	}
	c, err := a.lookup(ctx, name)
	if errors.Is(err, blobstore.ErrNotFound) {
		return Principal{}, ErrUnauthenticated
	}
	if err != nil {
		return Principal{}, err
	}
	if subtle.ConstantTimeCompare(h[:], c.hash[:]) != 1 {
		return Principal{}, ErrUnauthenticated
	}
	return Principal{Tenant: name}, nil
}

// Tenant returns a tenant's record (cached up to the cache TTL). The error
// wraps blobstore.ErrNotFound for an unknown tenant.
func (a *IAM) Tenant(ctx context.Context, name string) (Tenant, error) {
	c, err := a.lookup(ctx, name)
	return c.t, err
}

func (a *IAM) lookup(ctx context.Context, name string) (cached, error) {
	a.mu.Lock()
	c, ok := a.cache[name]
	a.mu.Unlock()
	if ok && a.now().Sub(c.loaded) < a.ttl {
		return c, nil
	}
	digest, err := a.refs.Get(ctx, refPrefix+name)
	if err != nil {
		return cached{}, fmt.Errorf("tenant %q: %w", name, err)
	}
	b, err := blobstore.ReadAll(ctx, a.blobs, digest)
	if err != nil {
		return cached{}, fmt.Errorf("tenant %q: %w", name, err)
	}
	var t Tenant
	if err := json.Unmarshal(b, &t); err != nil {
		return cached{}, fmt.Errorf("tenant %q: record %s: %w", name, digest, err)
	}
	raw, err := hex.DecodeString(t.TokenSHA256)
	if err != nil || len(raw) != sha256.Size {
		return cached{}, fmt.Errorf("tenant %q: record %s: bad tokenSha256", name, digest)
	}
	c = cached{t: t, loaded: a.now()}
	copy(c.hash[:], raw)
	a.mu.Lock()
	a.cache[name] = c
	a.mu.Unlock()
	return c, nil
}

// CreateTenant records a new tenant and returns its bearer token, which is
// not stored anywhere and cannot be shown again. Two replicas racing to
// create the same name may both succeed; the later record wins.
func (a *IAM) CreateTenant(ctx context.Context, name string, q Quota, defaults spec.Resources) (string, error) {
	if err := ValidateName(name); err != nil {
		return "", err
	}
	if err := q.Validate(); err != nil {
		return "", err
	}
	if err := defaults.Validate("defaults"); err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	_, err := a.refs.Get(ctx, refPrefix+name)
	if err == nil {
		return "", fmt.Errorf("%w: %q", ErrExists, name)
	}
	if !errors.Is(err, blobstore.ErrNotFound) {
		return "", fmt.Errorf("tenant %q: %w", name, err)
	}
	token := name + "." + randomHex(32)
	sum := sha256.Sum256([]byte(token))
	t := Tenant{Name: name, TokenSHA256: hex.EncodeToString(sum[:]), Quota: q, Defaults: defaults, Created: a.now().UTC()}
	if err := a.store(ctx, t, sum); err != nil {
		return "", err
	}
	return token, nil
}

// store writes t's record and points its ref at it.
func (a *IAM) store(ctx context.Context, t Tenant, sum [sha256.Size]byte) error {
	b, err := json.Marshal(t)
	if err != nil {
		return fmt.Errorf("tenant %q: %w", t.Name, err)
	}
	desc, err := a.blobs.Put(ctx, bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("tenant %q: store record: %w", t.Name, err)
	}
	if err := a.refs.Set(ctx, refPrefix+t.Name, desc.Digest); err != nil {
		return fmt.Errorf("tenant %q: store ref: %w", t.Name, err)
	}
	a.mu.Lock()
	a.cache[t.Name] = cached{t: t, hash: sum, loaded: a.now()}
	a.mu.Unlock()
	return nil
}

// UpdateTenant changes a tenant's quota and defaults: change gets the
// current record (read from the blob store, not the cache) and edits it;
// the name, token and creation time stay. Other replicas see the change
// within their cache TTL. Two replicas racing to update the same tenant
// may lose one of the changes (the later record wins), as for creates.
// The error wraps blobstore.ErrNotFound for an unknown tenant.
func (a *IAM) UpdateTenant(ctx context.Context, name string, change func(*Tenant)) (Tenant, error) {
	if err := ValidateName(name); err != nil {
		return Tenant{}, err
	}
	a.mu.Lock()
	delete(a.cache, name)
	a.mu.Unlock()
	c, err := a.lookup(ctx, name)
	if err != nil {
		return Tenant{}, err
	}
	t := c.t
	change(&t)
	t.Name, t.TokenSHA256, t.Created = c.t.Name, c.t.TokenSHA256, c.t.Created
	if err := t.Quota.Validate(); err != nil {
		return Tenant{}, err
	}
	if err := t.Defaults.Validate("defaults"); err != nil {
		return Tenant{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if err := a.store(ctx, t, c.hash); err != nil {
		return Tenant{}, err
	}
	return t, nil
}

// ListTenants returns every tenant's record, sorted by name.
func (a *IAM) ListTenants(ctx context.Context) ([]Tenant, error) {
	refs, err := a.refs.List(ctx, refPrefix)
	if err != nil {
		return nil, fmt.Errorf("list tenants: %w", err)
	}
	out := make([]Tenant, 0, len(refs))
	for _, r := range refs {
		name := strings.TrimPrefix(r.Name, refPrefix)
		if ValidateName(name) != nil {
			continue
		}
		t, err := a.Tenant(ctx, name)
		if errors.Is(err, blobstore.ErrNotFound) {
			continue // deleted since List read it
		}
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return hex.EncodeToString(b)
}

// NewSecret returns a fresh random token suitable for the admin or cluster
// token files.
func NewSecret() string { return randomHex(32) }

// EnsureTokenFile returns the token stored in path, creating the file (mode
// 0600) with a fresh secret if it does not exist. Several processes sharing
// a data dir may race here: exactly one creates the file and the rest read
// what it wrote.
func EnsureTokenFile(path string) (string, error) {
	if b, err := os.ReadFile(path); err == nil {
		return parseToken(path, b)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	// Write under a temp name and link it into place: a reader never sees
	// an empty file, and the link fails if another process won the race.
	tmp, err := os.CreateTemp(filepath.Dir(path), ".token-*")
	if err != nil {
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	secret := NewSecret()
	_, werr := tmp.WriteString(secret + "\n")
	if err := errors.Join(werr, tmp.Chmod(0o600), tmp.Sync(), tmp.Close()); err != nil {
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			b, rerr := os.ReadFile(path)
			if rerr != nil {
				return "", fmt.Errorf("token file %s: %w", path, rerr)
			}
			return parseToken(path, b)
		}
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	return secret, nil
}

func parseToken(path string, b []byte) (string, error) {
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("token file %s is empty", path)
	}
	return tok, nil
}

// BearerToken extracts the token from an Authorization header value.
func BearerToken(header string) (string, bool) {
	scheme, tok, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimSpace(tok)
	return tok, tok != ""
}
