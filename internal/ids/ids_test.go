package ids

import "testing"

func TestRoundTrip(t *testing.T) {
	for _, node := range []string{"n1", "edge-a", "0", "abcdefghijklmnopqrstuvwxyz012345"} {
		if err := ValidNode(node); err != nil {
			t.Fatal(err)
		}
		id := NewSandbox(node)
		got, err := NodeOf(id)
		if err != nil || got != node {
			t.Fatalf("NodeOf(%q) = %q, %v; want %q", id, got, err, node)
		}
	}
	if NewSandbox("n1") == NewSandbox("n1") {
		t.Fatal("two sandbox IDs are equal")
	}
}

func TestInvalid(t *testing.T) {
	for _, node := range []string{"", "N1", "-a", "a_b", "a.b", "abcdefghijklmnopqrstuvwxyz0123456"} {
		if ValidNode(node) == nil {
			t.Errorf("ValidNode(%q) accepted", node)
		}
	}
	for _, id := range []string{"", "n1", "n1-123", "n1-0123456789abcdeF", "-0123456789abcdef", "n1_0123456789abcdef"} {
		if _, err := NodeOf(id); err == nil {
			t.Errorf("NodeOf(%q) accepted", id)
		}
	}
}
