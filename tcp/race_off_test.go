//go:build !race

package tcp

// raceEnabled: this test binary has the race detector (race_on_test.go).
const raceEnabled = false
