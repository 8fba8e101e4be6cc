package remediateflag

import (
	"slices"
	"strings"
	"testing"

	"github.com/alecthomas/kingpin/v2"

	"github.com/gpu-orphan/gpu-orphan/remediate/exclude"
)

func TestProtectFlag(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    []string
		wantErr string
	}{
		{args: nil, want: nil},
		{args: []string{"--remediate.protect=my-daemon", "--remediate.protect=/opt/site/bin/server", "--remediate.protect=trainer-ctl*"},
			want: []string{"my-daemon", "/opt/site/bin/server", "trainer-ctl*"}},
		{args: []string{"--remediate.protect=bin/server"}, wantErr: `invalid --remediate.protect "bin/server": a name has no '/'`},
		{args: []string{"--remediate.protect=./server"}, wantErr: "a name has no '/'"},
		{args: []string{"--remediate.protect="}, wantErr: "invalid --remediate.protect: empty"},
	} {
		app := kingpin.New("test", "")
		r := AddRemediatorFlags(app)
		_, err := app.Parse(tc.args)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%v: err %v, want %q", tc.args, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if !slices.Equal(r.Protected, tc.want) {
			t.Errorf("%v: Protected %q, want %q", tc.args, r.Protected, tc.want)
		}
		got := r.DecideConfig().Protected
		if !slices.Equal(got, append(slices.Clone(exclude.DefaultProtected), tc.want...)) {
			t.Errorf("%v: the decision's Protected %q, want the built-in list and %q", tc.args, got, tc.want)
		}
	}
}
