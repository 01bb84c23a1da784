package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func get(t *testing.T, url, token string) (int, string) {
	t.Helper()
	r, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		r.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func testRegistry() *prometheus.Registry {
	reg := newRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "dsec_test_total", Help: "test"})
	c.Add(3)
	reg.MustRegister(c)
	return reg
}

// On the main port /metrics asks for the metrics token (created in the
// data dir on first start); /healthz asks for nothing.
func TestMetricsNeedToken(t *testing.T) {
	data := t.TempDir()
	reg := testRegistry()
	var mf metricsFlags
	h, ln, err := mf.open(data, reg)
	if err != nil || ln != nil || h == nil {
		t.Fatalf("open: %v, %v, %v", h, ln, err)
	}
	srv := httptest.NewServer(newMux(h))
	defer srv.Close()
	b, err := os.ReadFile(filepath.Join(data, metricsFile))
	if err != nil {
		t.Fatal(err)
	}
	tok := strings.TrimSpace(string(b))
	if info, _ := os.Stat(filepath.Join(data, metricsFile)); info.Mode().Perm() != 0o600 {
		t.Errorf("metrics.token mode %v, want 0600", info.Mode().Perm())
	}
	for _, tc := range []struct{ token string }{{""}, {"wrong"}} {
		if code, body := get(t, srv.URL+"/metrics", tc.token); code != http.StatusUnauthorized || strings.Contains(body, "dsec_test_total") {
			t.Errorf("/metrics with token %q: %d %q, want 401 and no metrics", tc.token, code, body)
		}
	}
	if code, body := get(t, srv.URL+"/metrics", tok); code != http.StatusOK || !strings.Contains(body, "dsec_test_total 3") {
		t.Errorf("/metrics with the metrics token: %d, want 200 with the metrics", code)
	}
	if code, _ := get(t, srv.URL+"/healthz", ""); code != http.StatusOK {
		t.Errorf("/healthz without a token: %d, want 200", code)
	}

	// A given token file is used as it is.
	file := filepath.Join(t.TempDir(), "prom.token")
	if err := os.WriteFile(file, []byte("scrape-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	mf = metricsFlags{tokenFile: file}
	h, _, err = mf.open(data, reg)
	if err != nil {
		t.Fatal(err)
	}
	srv2 := httptest.NewServer(newMux(h))
	defer srv2.Close()
	if code, _ := get(t, srv2.URL+"/metrics", "scrape-secret"); code != http.StatusOK {
		t.Errorf("/metrics with --metrics-token-file's token: %d, want 200", code)
	}
	if code, _ := get(t, srv2.URL+"/metrics", tok); code != http.StatusUnauthorized {
		t.Errorf("/metrics with another token: %d, want 401", code)
	}
}

// With --metrics-addr /metrics is served there, without a token, and not
// on the main port at all.
func TestMetricsAddr(t *testing.T) {
	reg := testRegistry()
	mf := metricsFlags{addr: "127.0.0.1:0"}
	h, ln, err := mf.open(t.TempDir(), reg)
	if err != nil || h != nil || ln == nil {
		t.Fatalf("open: %v, %v, %v", h, ln, err)
	}
	main := httptest.NewServer(newMux(h))
	defer main.Close()
	if code, body := get(t, main.URL+"/metrics", ""); code != http.StatusNotFound || strings.Contains(body, "dsec_test_total") {
		t.Errorf("main port /metrics: %d %q, want 404", code, body)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- mf.serve(ctx, ln, reg, slog.New(slog.DiscardHandler)) }()
	defer func() { cancel(); <-done }()
	if code, body := get(t, "http://"+ln.Addr().String()+"/metrics", ""); code != http.StatusOK || !strings.Contains(body, "dsec_test_total 3") {
		t.Errorf("--metrics-addr /metrics: %d, want 200 with the metrics", code)
	}
}
