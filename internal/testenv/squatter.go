package testenv

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// Recorded is a request as a Squatter saw it.
type Recorded struct {
	Method, URI string
	Header      http.Header
	Body        []byte
}

// Squatter is a user's listener on the port of a node whose agent is
// down: it answers 401, as the user did, and records what it got.
type Squatter struct {
	*httptest.Server
	mu  sync.Mutex
	got []Recorded
}

// NewSquatter starts a Squatter, closed at the test's end.
func NewSquatter(t testing.TB) *Squatter {
	s := &Squatter{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.got = append(s.got, Recorded{r.Method, r.RequestURI, r.Header.Clone(), b})
		s.mu.Unlock()
		http.Error(w, "missing or wrong bearer token", http.StatusUnauthorized)
	}))
	t.Cleanup(s.Close)
	return s
}

// Requests are the requests the Squatter got so far.
func (s *Squatter) Requests() []Recorded {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Recorded(nil), s.got...)
}

// Replay sends r, as it was recorded, to base, and returns the status.
func Replay(t testing.TB, base string, r Recorded) int {
	t.Helper()
	req, err := http.NewRequest(r.Method, base+r.URI, bytes.NewReader(r.Body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// WaitReady waits, up to timeout (Eventually), until base's /-/ready
// answers 200; a connection refused is not ready yet.
func WaitReady(t testing.TB, base, what string, timeout time.Duration) {
	t.Helper()
	Eventually(t, timeout, what+" to be ready", func() bool {
		resp, err := http.Get(base + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}
