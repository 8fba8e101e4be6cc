// Package cmd holds the binaries, one directory each, and two Go tests of
// the whole module: one keeps the README's "Binaries and flags" section
// equal to what the binaries' --help says, the other (imports_test.go)
// that imports only run down, cmd -> remediate, exporter -> internal, as
// `go list` reports them. It has no code of its own.
package cmd
