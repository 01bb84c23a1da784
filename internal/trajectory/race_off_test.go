//go:build !race

package trajectory_test

const raceEnabled = false
