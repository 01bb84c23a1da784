package main

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// /healthz answers 503 with the reason until the daemon is usable, then 200.
func TestHealthzWaitsForReady(t *testing.T) {
	var ready atomic.Bool
	srv := httptest.NewServer(newMuxHealth(nil, func() error {
		if !ready.Load() {
			return errors.New("the local edge has not registered yet")
		}
		return nil
	}))
	defer srv.Close()
	get := func() (int, string) {
		resp, err := http.Get(srv.URL + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get(); code != http.StatusServiceUnavailable || !strings.Contains(body, "not registered") {
		t.Fatalf("before ready: %d %q, want 503 naming the reason", code, body)
	}
	ready.Store(true)
	if code, body := get(); code != http.StatusOK || strings.TrimSpace(body) != "ok" {
		t.Fatalf("after ready: %d %q, want 200 ok", code, body)
	}
}
