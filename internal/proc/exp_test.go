package proc

import (
	"os"
	"testing"
	"time"
)

func TestExp(t *testing.T) {
	if os.Getenv("EXP") == "" {
		t.Skip()
	}
	bench.once.Do(func() { bench.err = startBenchProcs() })
	os.WriteFile("/tmp/exp.ready", []byte(bench.target), 0o644)
	time.Sleep(90 * time.Second)
}
