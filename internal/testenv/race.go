//go:build race

package testenv

// RaceEnabled: this test binary is built with -race, and so are the
// binaries that Bin builds. Their memory and speed are then the race
// detector's, not the program's: tests that bound them check only without it.
const RaceEnabled = true
