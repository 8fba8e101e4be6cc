package store

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"sync"
	"time"
)

// timeLayout is RFC 3339 in UTC with all nine fractional digits: fixed
// width, so text order is time order and SQL range filters work, and
// readable in the sqlite3 shell. The zero time is stored as year 1 and
// comes back as the zero time.
const timeLayout = "2006-01-02T15:04:05.000000000Z07:00"

func formatTime(t time.Time) string { return t.UTC().Format(timeLayout) }

func parseTime(s string) (time.Time, error) {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("parsing stored time %q: %w", s, err)
	}
	return t.UTC(), nil
}

func toJSON(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("encoding %T: %w", v, err)
	}
	return string(b), nil
}

func fromJSON(s string, v any) error {
	if err := json.Unmarshal([]byte(s), v); err != nil {
		return fmt.Errorf("decoding stored %T: %w", v, err)
	}
	return nil
}

// idSource makes action IDs that sort by creation time: 16 hex digits of
// Unix nanoseconds, then 8 random hex digits so that two processes (the
// remediator and the CLI) cannot collide. Within a process the time part
// strictly increases, even if the clock steps back.
type idSource struct {
	mu   sync.Mutex
	last int64
}

func (g *idSource) next() string {
	g.mu.Lock()
	n := time.Now().UnixNano()
	if n <= g.last {
		n = g.last + 1
	}
	g.last = n
	g.mu.Unlock()

	var b [4]byte
	rand.Read(b[:]) // never fails on Linux (Go 1.24+ crashes instead)
	return fmt.Sprintf("%016x%08x", uint64(n), binary.BigEndian.Uint32(b[:]))
}
