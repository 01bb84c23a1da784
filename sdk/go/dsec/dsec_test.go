package dsec

import (
	"errors"
	"testing"

	dsecv1 "github.com/dsec-dev/dsec/api/dsec/v1"
)

func TestResolveEndpoint(t *testing.T) {
	t.Setenv(EnvEndpoint, "")
	if got := ResolveEndpoint(""); got != DefaultEndpoint {
		t.Errorf("default endpoint %q, want %q", got, DefaultEndpoint)
	}
	t.Setenv(EnvEndpoint, "10.0.0.1:7110/")
	if got := ResolveEndpoint(""); got != "http://10.0.0.1:7110" {
		t.Errorf("endpoint from env %q", got)
	}
	if got := ResolveEndpoint("https://dsec.example"); got != "https://dsec.example" {
		t.Errorf("explicit endpoint %q", got)
	}
}

func TestBatchErrorsKeepCodes(t *testing.T) {
	err := batchErr([]error{
		itemError("sandbox 1 of 2", &dsecv1.ItemError{Code: "resource_exhausted", Message: "quota"}),
		itemError("sandbox 2 of 2", &dsecv1.ItemError{Code: "bogus", Message: "?"}),
	})
	var be *BatchError
	if !errors.As(err, &be) || len(be.Errs) != 2 {
		t.Fatalf("batchErr = %v", err)
	}
	if !IsResourceExhausted(be.Errs[0]) || !IsResourceExhausted(err) {
		t.Errorf("first item error lost its code: %v", be.Errs[0])
	}
	if IsNotFound(be.Errs[1]) || Code(be.Errs[1]).String() != "unknown" {
		t.Errorf("unknown code mapped to %v", Code(be.Errs[1]))
	}
	if batchErr(nil) != nil {
		t.Error("batchErr(nil) is not nil")
	}
}
