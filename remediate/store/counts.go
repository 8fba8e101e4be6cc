package store

import (
	"context"
	"fmt"

	"github.com/gpu-orphan/gpu-orphan/remediate"
)

// CountFinished counts the finished actions of the store by source and
// state, whoever recorded them: this process, another remediator, or
// `gpu-orphan clean`, `prolog` and `epilog` sharing the file. Only final
// states are counted, so that each count only grows while the file lives.
// One GROUP BY, read from the actions_source_state index alone (queued
// and running actions, few, are left out here rather than in SQL, where
// the filter would make SQLite read another index and sort).
func (s *Store) CountFinished(ctx context.Context) ([]remediate.RecordedCount, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT source, state, count(*) FROM actions GROUP BY source, state ORDER BY source, state`)
	if err != nil {
		return nil, fmt.Errorf("counting recorded actions: %w", err)
	}
	defer rows.Close()
	var out []remediate.RecordedCount
	for rows.Next() {
		var c remediate.RecordedCount
		if err := rows.Scan(&c.Source, &c.State, &c.Count); err != nil {
			return nil, fmt.Errorf("counting recorded actions: %w", err)
		}
		if c.State.Final() {
			out = append(out, c)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("counting recorded actions: %w", err)
	}
	return out, nil
}
