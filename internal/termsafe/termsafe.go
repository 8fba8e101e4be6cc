// Package termsafe makes text that processes and users chose safe to print
// on a terminal: a process may name itself with escape sequences that move
// the cursor, rewrite lines or change the terminal's title.
package termsafe

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Escape returns s with every control character written as an escape, so
// that it prints as what it is and does nothing to the terminal: C0
// controls and DEL as \t, \n, \r or \xNN, C1 controls and the characters
// that reorder or separate lines (bidirectional overrides and isolates,
// U+2028, U+2029) as \uNNNN, and bytes that are not UTF-8 as \xNN.
// Backslashes are kept as they are: cgroup and systemd names use them
// (\x2d), and a name that spells an escape is rarer than one that has one.
// Printable text, any script, comes back unchanged.
func Escape(s string) string {
	i := strings.IndexFunc(s, needsEscape)
	if i < 0 && utf8.ValidString(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	for len(s) > 0 {
		r, size := utf8.DecodeRuneInString(s)
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[0])
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, r)
		case needsEscape(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[:size])
		}
		s = s[size:]
	}
	return b.String()
}

// needsEscape reports whether r does something to a terminal or to the
// order in which a line is shown.
func needsEscape(r rune) bool {
	switch {
	case r < 0x20, r >= 0x7f && r <= 0x9f: // C0, DEL, C1 (CSI is U+009B)
		return true
	case r == 0x061c, r == 0x200e, r == 0x200f, // bidirectional marks
		r >= 0x202a && r <= 0x202e, // embeddings and overrides
		r >= 0x2066 && r <= 0x2069, // isolates
		r == 0x2028, r == 0x2029:   // line and paragraph separators
		return true
	}
	return false
}
