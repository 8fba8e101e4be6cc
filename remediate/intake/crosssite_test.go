package intake

import "testing"

// TestHostAllowed: the open page (and, with --auth.insecure-none, every
// request without a credential) answers IP addresses, localhost and the
// names it is given, whatever the port and case; any other name, which a
// rebound DNS name would be, is refused.
func TestHostAllowed(t *testing.T) {
	names := []string{"gpu-17.example.com", "node-a"}
	for host, want := range map[string]bool{
		"127.0.0.1:10836":                 true,
		"10.0.0.5":                        true,
		"[::1]:10836":                     true,
		"localhost:10836":                 true,
		"app.localhost":                   true,
		"gpu-17.example.com:443":          true,
		"GPU-17.Example.COM.":             true,
		"node-a":                          true,
		"evil.example:10836":              false,
		"gpu-17.example.com.evil.example": false,
		"node-a.evil.example":             false,
		"":                                false,
		"127.0.0.1.nip.io:10836":          false,
	} {
		if got := HostAllowed(host, names); got != want {
			t.Errorf("HostAllowed(%q) = %t, want %t", host, got, want)
		}
	}
}
