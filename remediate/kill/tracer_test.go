package kill

import "testing"

// TestParseStatus reads the state, the tracer and the thread group of
// /proc/PID/status; a status without them is an error, never "untraced".
func TestParseStatus(t *testing.T) {
	for _, tc := range []struct {
		name, in     string
		state        string
		tracer, tgid int
		wantErr      bool
	}{
		{"traced, stopped at its exit", "Name:\tgpu-orphan-sim\nState:\tt (tracing stop)\nTgid:\t812\nPid:\t812\nPPid:\t1\nTracerPid:\t907\n", "t", 907, 812, false},
		{"untraced", "Name:\tpython3\nState:\tS (sleeping)\nTgid:\t40\nTracerPid:\t0\n", "S", 0, 40, false},
		{"a thread of a tracer", "State:\tS (sleeping)\nTgid:\t900\nPid:\t907\nTracerPid:\t0\n", "S", 0, 900, false},
		{"no TracerPid", "State:\tS (sleeping)\nTgid:\t40\n", "", 0, 0, true},
		{"bad TracerPid", "State:\tS (sleeping)\nTgid:\t40\nTracerPid:\tx\n", "", 0, 0, true},
	} {
		state, tracer, tgid, err := parseStatus([]byte(tc.in))
		if (err != nil) != tc.wantErr || state != tc.state || tracer != tc.tracer || tgid != tc.tgid {
			t.Errorf("%s: %q %d %d %v; want %q %d %d, error %v", tc.name, state, tracer, tgid, err, tc.state, tc.tracer, tc.tgid, tc.wantErr)
		}
	}
}
