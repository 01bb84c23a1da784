//go:build race

package trajectory_test

const raceEnabled = true
