//go:build !unix

package store

import "os"

// fileOwner is the UID that owns fi: none where files have no UID.
func fileOwner(os.FileInfo) (int, bool) { return os.Geteuid(), true }
