package remediateflag

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/alecthomas/kingpin/v2"

	"github.com/gpu-orphan/gpu-orphan/remediate/app"
)

// TestStorePathDefault: without --store.path the audit database is
// DefaultStorePath, for root and any other user, and Finish logs that it
// is the default; a path given is used and not remarked upon.
func TestStorePathDefault(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
		said bool
	}{
		{nil, DefaultStorePath, true},
		{[]string{"--store.path=/srv/audit.db"}, "/srv/audit.db", false},
		{[]string{"--store.path=" + DefaultStorePath}, DefaultStorePath, false},
	} {
		a := kingpin.New("test", "")
		var o app.Options
		s := AddServerFlags(a, &o)
		var log bytes.Buffer
		s.log.Writer = &log
		if _, err := a.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if err := s.Finish(); err != nil {
			t.Fatal(err)
		}
		if o.StorePath != tc.want {
			t.Errorf("%v: store %q, want %q", tc.args, o.StorePath, tc.want)
		}
		line := `level=INFO source=server.go:[0-9]+ msg="No --store.path given: the audit database is the default" store=` + regexp.QuoteMeta(DefaultStorePath) + "\n"
		if said := regexp.MustCompile(line).MatchString(log.String()); said != tc.said {
			t.Errorf("%v: logged %q; want the line %q: %v", tc.args, log.String(), line, tc.said)
		}
	}
	a := kingpin.New("test", "")
	AddServerFlags(a, &app.Options{})
	help := a.GetFlag("store.path").Model().Help
	if !strings.Contains(help, DefaultStorePath+", for root and for any other user alike") || !strings.Contains(help, "the start-up log says so") {
		t.Errorf("--store.path's help does not say its default for root and others: %q", help)
	}
}
