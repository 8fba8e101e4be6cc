//go:build !gpuorphan_pausepoints

package cleanup

// pausePoint does nothing: the crash tests' pause points exist only in a
// binary built with -tags gpuorphan_pausepoints (pausepoint.go).
func pausePoint(string) {}

func pauseWarning() string { return "" }
