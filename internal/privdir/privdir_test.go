package privdir

import "testing"

func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"/var/lib/gpu-orphan": "/var/lib/gpu-orphan",
		"/tmp/a b":            "'/tmp/a b'",
		"/tmp/it's":           `'/tmp/it'\''s'`,
		"":                    "''",
	} {
		if got := ShellQuote(in); got != want {
			t.Errorf("ShellQuote(%q) = %s, want %s", in, got, want)
		}
	}
}
