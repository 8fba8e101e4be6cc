package exporter_test

// psReport is the part of `gpu-orphan ps -o json` that these tests read,
// decoded by the field names that scripts rely on.
type psReport struct {
	FDScanUnreadableProcesses int `json:"fdscan_unreadable_processes"`
	GPUs                      []struct {
		UnownedBytes   uint64 `json:"unowned_bytes"`
		OwnedDeadBytes uint64 `json:"owned_dead_bytes"`
		Owners         []struct {
			PID          uint32 `json:"pid"`
			Alive        bool   `json:"alive"`
			LeaderExited bool   `json:"leader_exited"`
			ReusedBy     *struct {
				PID       int    `json:"pid"`
				Comm      string `json:"comm"`
				StartTime uint64 `json:"start_time"`
			} `json:"reused_by"`
		} `json:"owners"`
		Suspects []struct {
			PID    int    `json:"pid"`
			Reason string `json:"reason"`
		} `json:"suspects"`
	} `json:"gpus"`
}
