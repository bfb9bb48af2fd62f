//go:build race

package tcp

// raceEnabled: this test binary has the race detector (race_off_test.go says otherwise).
const raceEnabled = true
