package testsuite

import "testing"

// The adversarial section: what a sandbox's own workload does to fake a
// result or hurt the node (read the platform's channels, change or starve
// PID 1, exhaust the host, turn its own failure into an infrastructure
// error), each written as the attack and the behaviour that must hold. Every
// backend runs it, the VM backends included; a case that cannot apply to a
// backend skips through Harness.Lacks like the rest of the suite.
//
// Cases live in adversarial_*.go, one file per kind of attack, each adding
// itself to adversarialCases from an init function (files are initialised
// in name order, so the order is stable).

// advCase is one attack and what must hold after it.
type advCase struct {
	name string
	run  func(s *suite, t *testing.T)
}

var adversarialCases []advCase

func (s *suite) testAdversarial(t *testing.T) {
	for _, c := range adversarialCases {
		t.Run(c.name, func(t *testing.T) { c.run(s, t) })
	}
}
