// Package cmd holds the binaries, one directory each, and a Go test that
// keeps the README's "Binaries and flags" section equal to what the
// binaries' --help says. It has no code of its own.
package cmd
