package termsafe

import "testing"

func TestEscape(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", ""},
		{"python3", "python3"},
		{"pt_data_worker:0", "pt_data_worker:0"},
		{"Grüße, 训练, ✓", "Grüße, 训练, ✓"},
		{`dev-disk-by\x2duuid`, `dev-disk-by\x2duuid`}, // a backslash stays
		{"\x1b[1A\x1b[2K  no suspect", `\x1b[1A\x1b[2K  no suspect`},
		{"a\tb\nc\rd", `a\tb\nc\rd`},
		{"bell\x07 nul\x00 del\x7f", `bell\x07 nul\x00 del\x7f`},
		{"csi\u009b2J", `csi\u009b2J`},
		{"\u202eevil\u2066x\u2069", `\u202eevil\u2066x\u2069`},
		{"line\u2028sep", `line\u2028sep`},
		{"bad\xff\xfeutf8", `bad\xff\xfeutf8`},
		{"\x1b]0;title\x07", `\x1b]0;title\x07`},
	} {
		if got := Escape(tc.in); got != tc.want {
			t.Errorf("Escape(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestEscapeLeavesNothingForTheTerminal(t *testing.T) {
	for b := range 256 {
		s := string([]byte{'x', byte(b), 'y'})
		out := Escape(s)
		for _, r := range out {
			if needsEscape(r) {
				t.Errorf("Escape(%q) = %q still holds %U", s, out, r)
			}
		}
	}
}
