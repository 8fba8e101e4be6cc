//go:build race

package testenv

// raceEnabled: this test binary is built with -race, and so are the
// binaries that Bin builds.
const raceEnabled = true
