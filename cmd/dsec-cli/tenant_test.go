package main

import (
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// TestTenantFlags: update sends only the flags given (0 included: it sets
// a quota back to unlimited or a default back to the node's), parsed as
// --cpu and --memory are; bad values are usage errors naming the flag.
func TestTenantFlags(t *testing.T) {
	parse := func(args ...string) (*tenantFlags, *pflag.FlagSet) {
		t.Helper()
		var f tenantFlags
		fs := pflag.NewFlagSet("tenant", pflag.ContinueOnError)
		f.register(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		return &f, fs
	}
	f, fs := parse("--max-cpu", "1.5", "--default-memory", "512m", "--default-pids", "0", "--default-disk", "2g", "--max-import-size", "1g")
	u, err := f.update(fs)
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case u.MaxMilliCPU == nil || *u.MaxMilliCPU != 1500:
		t.Errorf("max-cpu 1.5: %v", u.MaxMilliCPU)
	case u.DefaultMemoryBytes == nil || *u.DefaultMemoryBytes != 512<<20:
		t.Errorf("default-memory 512m: %v", u.DefaultMemoryBytes)
	case u.DefaultPids == nil || *u.DefaultPids != 0:
		t.Errorf("default-pids 0 must be sent (back to the node's): %v", u.DefaultPids)
	case u.DefaultDiskBytes == nil || *u.DefaultDiskBytes != 2<<30:
		t.Errorf("default-disk 2g: %v", u.DefaultDiskBytes)
	case u.MaxImportBytes == nil || *u.MaxImportBytes != 1<<30:
		t.Errorf("max-import-size 1g: %v", u.MaxImportBytes)
	case u.MaxSandboxes != nil || u.MaxMemoryBytes != nil || u.DefaultMilliCPU != nil:
		t.Errorf("flags not given were sent: %+v", u)
	}
	for _, tc := range [][]string{
		{"--max-sandboxes", "-1"},
		{"--default-pids", "-3"},
		{"--default-cpu", "lots"},
		{"--default-disk", "-1g"},
		{"--max-import-size", "big"},
	} {
		f, fs := parse(tc...)
		_, err := f.update(fs)
		if err == nil || !strings.Contains(err.Error(), tc[0]) {
			t.Errorf("%q: %v, want a usage error naming the flag", tc, err)
		}
	}
}
