package slowness

import (
	"testing"
	"time"
)

func TestFromLoad(t *testing.T) {
	for _, tc := range []struct {
		loadavg string
		cpus    int
		want    float64
	}{
		{"7.00 5.10 3.20 5/912 4242\n", 2, 3.5},
		{"0.30 0.20 0.10 1/100 1\n", 2, 1}, // idle: never below 1
		{"400.0 1 1 1/1 1", 2, Max},        // a bound on waiting
		{"", 2, 1},
		{"x 1 1", 2, 1},
		{"3 1 1", 0, 1},
	} {
		if got := fromLoad(tc.loadavg, tc.cpus); got != tc.want {
			t.Errorf("fromLoad(%q, %d) = %v, want %v", tc.loadavg, tc.cpus, got, tc.want)
		}
	}
}

func TestFactor(t *testing.T) {
	for _, tc := range []struct {
		env  string
		want float64
	}{{"3.5", 3.5}, {"0.5", 0.5}, {"100", Max}} {
		t.Setenv(Env, tc.env)
		if got := Factor(); got != tc.want {
			t.Errorf("%s=%s: %v, want %v", Env, tc.env, got, tc.want)
		}
	}
	for _, env := range []string{"", "fast", "0", "-2"} {
		t.Setenv(Env, env)
		if got := Factor(); got < 1 || got > Max {
			t.Errorf("%s=%q: %v from this machine's load, want 1 to %d", Env, env, got, Max)
		}
	}
	if got := Scale(2*time.Second, 3.5); got != 7*time.Second {
		t.Errorf("Scale = %s", got)
	}
}
