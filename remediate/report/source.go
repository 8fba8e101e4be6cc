package report

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// Source lists the actions that started in [since, until), newest first,
// at most limit of them: an audit store, or a remediator's API.
type Source interface {
	Actions(ctx context.Context, since, until time.Time, limit int) ([]remediate.Action, error)
}

// pageSize is the most actions one page asks for: the API's cap.
const pageSize = store.MaxLimit

// Collect reads every action that started in [since, until) from src,
// page by page, newest first.
func Collect(ctx context.Context, src Source, since, until time.Time) ([]remediate.Action, error) {
	var out []remediate.Action
	seen := map[string]bool{}
	for {
		page, err := src.Actions(ctx, since, until, pageSize)
		if err != nil {
			return nil, err
		}
		fresh := 0
		for _, a := range page {
			if !seen[a.ID] {
				seen[a.ID] = true
				out = append(out, a)
				fresh++
			}
		}
		if len(page) < pageSize || fresh == 0 {
			return out, nil
		}
		// The next page ends with the oldest start seen, included: actions
		// that started in the same nanosecond are not lost, and those seen
		// are skipped.
		until = page[len(page)-1].StartedAt.Add(time.Nanosecond)
	}
}

// StoreSource reads an audit store.
type StoreSource struct{ Store *store.Store }

// Actions implements Source.
func (s StoreSource) Actions(ctx context.Context, since, until time.Time, limit int) ([]remediate.Action, error) {
	return s.Store.Actions(ctx, store.Filter{Since: since, Until: until, Limit: limit})
}

// APISource reads a remediator's (or a dispatcher's) GET /api/v1/actions.
type APISource struct {
	// URL is the remediator's base URL, http(s)://host:port.
	URL string
	// Token is sent as a bearer token when not empty.
	Token  string
	Client *http.Client
}

// NewAPISource checks the URL and returns a source for it.
func NewAPISource(base, token string, client *http.Client) (APISource, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" {
		return APISource{}, fmt.Errorf("invalid remediator URL %q: want http(s)://host:port", base)
	}
	if client == nil {
		client = &http.Client{Timeout: 30 * time.Second}
	}
	return APISource{URL: strings.TrimSuffix(u.String(), "/"), Token: token, Client: client}, nil
}

// Actions implements Source.
func (s APISource) Actions(ctx context.Context, since, until time.Time, limit int) ([]remediate.Action, error) {
	q := url.Values{}
	if !since.IsZero() {
		q.Set("since", since.UTC().Format(time.RFC3339Nano))
	}
	if !until.IsZero() {
		q.Set("until", until.UTC().Format(time.RFC3339Nano))
	}
	q.Set("limit", strconv.Itoa(limit))
	endpoint := s.URL + "/api/v1/actions?" + q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint, nil)
	if err != nil {
		return nil, err
	}
	if s.Token != "" {
		req.Header.Set("Authorization", "Bearer "+s.Token)
	}
	resp, err := s.Client.Do(req)
	if err != nil {
		// Not the whole request URL again: what went wrong.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("asking the remediator at %s: %w", s.URL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil {
		return nil, fmt.Errorf("reading the answer of %s: %w", s.URL, err)
	}
	switch {
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		return nil, fmt.Errorf("the remediator at %s refused the request (%s): give its bearer token with --auth.token-file", s.URL, resp.Status)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("the remediator at %s answered %s: %s", s.URL, resp.Status, apiError(body))
	}
	var out []remediate.Action
	if err := json.Unmarshal(body, &out); err != nil {
		return nil, fmt.Errorf("the remediator at %s answered what is not a list of actions: %w", s.URL, err)
	}
	return out, nil
}

// apiError is the API's {"error": ...} message, or the body's start.
func apiError(body []byte) string {
	var e struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error != "" {
		return e.Error
	}
	s := strings.TrimSpace(string(body))
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	if s == "" {
		return "(no body)"
	}
	return s
}
