package s3store

import "time"

// WithClock returns a copy of s whose clock is now, for tests of the
// refresh of stored content's age.
func WithClock(s *Store, now func() time.Time) *Store {
	c := *s
	c.now = now
	return &c
}
