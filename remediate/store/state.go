package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// MaxStateBytes bounds one state value.
const MaxStateBytes = 4 << 20

// PutState keeps value under name, replacing what was there.
func (s *Store) PutState(ctx context.Context, name string, value []byte) error {
	if len(value) > MaxStateBytes {
		return fmt.Errorf("state %q: %d bytes, more than %d", name, len(value), MaxStateBytes)
	}
	_, err := s.db.ExecContext(ctx, `INSERT INTO state (name, value, updated_at) VALUES (?, ?, ?)
		ON CONFLICT(name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at`,
		name, value, formatTime(time.Now()))
	if err != nil {
		return fmt.Errorf("writing state %q: %w", name, err)
	}
	return nil
}

// GetState returns the value kept under name; ok is false when there is
// none.
func (s *Store) GetState(ctx context.Context, name string) (value []byte, ok bool, err error) {
	err = s.db.QueryRowContext(ctx, `SELECT value FROM state WHERE name = ?`, name).Scan(&value)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil, false, nil
	case err != nil:
		return nil, false, fmt.Errorf("reading state %q: %w", name, err)
	}
	return value, true, nil
}
