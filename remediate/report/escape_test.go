package report

import (
	"bytes"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// TestWriteEscapesKeys: a key is a name that a user or a process chose (a
// comm, a user name): gpu-orphan report's table and CSV print its control
// characters as escapes, and the table's columns stay aligned; JSON keeps
// the key, escaped by its encoder.
func TestWriteEscapesKeys(t *testing.T) {
	at := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	r := Report{By: ByComm, Since: at.Add(-time.Hour), Until: at, Events: 2, Rows: []Row{
		{Key: "\x1b[1A\x1b[2Kpython\t", Events: 1, FreedBytes: 1 << 30, Last: at},
		{Key: "python", Events: 1, FreedBytes: 1 << 30, Last: at},
	}}
	for _, format := range []string{"table", "csv"} {
		var b bytes.Buffer
		if err := Write(&b, r, format); err != nil {
			t.Fatal(err)
		}
		out := b.String()
		for i, c := range out {
			if c < 0x20 && c != '\n' {
				t.Fatalf("%s: control character %q at byte %d:\n%q", format, c, i, out)
			}
		}
		if !strings.Contains(out, `\x1b[1A\x1b[2Kpython\t`) {
			t.Errorf("%s: the key, escaped, is missing:\n%s", format, out)
		}
	}
	var b bytes.Buffer
	if err := Write(&b, r, "table"); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	last := lines[len(lines)-3:] // the header and the two rows
	for _, l := range last[1:] {
		if utf8.RuneCountInString(l) != utf8.RuneCountInString(last[0]) {
			t.Errorf("the columns are not aligned:\n%s", strings.Join(last, "\n"))
			break
		}
	}
	b.Reset()
	if err := Write(&b, r, "json"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), `"key": "\u001b[1A\u001b[2Kpython\t"`) {
		t.Errorf("json:\n%s", b.String())
	}
}
