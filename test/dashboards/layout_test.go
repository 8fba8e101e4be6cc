package dashboards

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// TestDashboardLayout: every panel fits Grafana's 24 columns, and no two
// overlap: a panel added beside others moves them, not onto them.
func TestDashboardLayout(t *testing.T) {
	files, err := filepath.Glob("../../dashboards/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no dashboards: %v", err)
	}
	for _, f := range files {
		t.Run(f, func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var d struct {
				Panels []struct {
					ID      int    `json:"id"`
					Title   string `json:"title"`
					GridPos struct {
						X, Y, W, H int
					} `json:"gridPos"`
				} `json:"panels"`
			}
			if err := json.Unmarshal(data, &d); err != nil {
				t.Fatal(err)
			}
			type cell struct{ x, y int }
			taken := map[cell]string{}
		panels:
			for _, p := range d.Panels {
				g := p.GridPos
				if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
					t.Errorf("panel %d %q: gridPos %+v does not fit 24 columns", p.ID, p.Title, g)
					continue
				}
				for x := g.X; x < g.X+g.W; x++ {
					for y := g.Y; y < g.Y+g.H; y++ {
						if other, ok := taken[cell{x, y}]; ok {
							t.Errorf("panel %d %q overlaps %s at column %d, row %d", p.ID, p.Title, other, x, y)
							continue panels
						}
						taken[cell{x, y}] = p.Title
					}
				}
			}
		})
	}
}
