package snapshot

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"
)

// What a Lineage keeps across a restart: the owners it saw alive, the
// descent it recorded, and since when each dead owner has been dead. PIDs
// and start times mean something only until the next boot, so the state
// names the boot it was written in, and a state from another boot (or
// another node) is foreign: refused, never merged.

// stateVersion is the layout of LineageState.
const stateVersion = 1

// Bounds of a saved state, whatever the Lineage holds.
const (
	maxStateOwners      = DefaultMaxOwners
	maxStateDescendants = 16384
)

// ErrForeignState is returned for a state written in another boot.
var ErrForeignState = errors.New("the state was written in another boot: its PIDs name other processes now")

// lineageState is the saved form; its fields are a file format.
type lineageState struct {
	Version int            `json:"version"`
	BootID  string         `json:"boot_id"`
	Saved   time.Time      `json:"saved"`
	Owners  []savedOwner   `json:"owners"`
	Descent []savedDescent `json:"descent,omitempty"`
	// Inherited are the holders proven inheritors at fork, in the same
	// form as Descent.
	Inherited []savedDescent `json:"inherited,omitempty"`
	Dead      []savedDead    `json:"dead,omitempty"`
}

type savedOwner struct {
	GPU      string    `json:"gpu"`
	Identity Identity  `json:"identity"`
	Listed   time.Time `json:"listed"`
}

type savedDescent struct {
	GPU        string      `json:"gpu"`
	OwnerPID   int         `json:"owner_pid"`
	OwnerStart uint64      `json:"owner_start"`
	Procs      [][2]uint64 `json:"procs"` // [pid, start time]
	// Proof is how Procs were proven inheritors (in Inherited only).
	Proof string `json:"proof,omitempty"`
}

type savedDead struct {
	GPU   string    `json:"gpu"`
	PID   int       `json:"pid"`
	Since time.Time `json:"since"`
}

// MarshalState returns what l remembers, for bootID (the kernel's
// /proc/sys/kernel/random/boot_id), bounded in size: the owners listed
// most recently first.
func (l *Lineage) MarshalState(bootID string) ([]byte, error) {
	l.mu.Lock()
	st := lineageState{Version: stateVersion, BootID: bootID, Saved: time.Now().UTC()}
	for k, e := range l.owners.entries {
		st.Owners = append(st.Owners, savedOwner{GPU: k.uuid, Identity: e.id, Listed: e.listed})
	}
	n := 0
	add := func(out []savedDescent, k ownerKey, proof string, procs []procKey) []savedDescent {
		sd := savedDescent{GPU: k.uuid, OwnerPID: k.pid, OwnerStart: k.startTime, Proof: proof}
		for _, p := range procs {
			if n >= maxStateDescendants {
				break
			}
			sd.Procs = append(sd.Procs, [2]uint64{uint64(p.pid), p.start})
			n++
		}
		if len(sd.Procs) > 0 {
			out = append(out, sd)
		}
		return out
	}
	// The proven first: they are what the bound must not cut.
	for k, d := range l.inherited {
		byProof := map[string][]procKey{}
		for p, proof := range d {
			byProof[proof] = append(byProof[proof], p)
		}
		for proof, procs := range byProof {
			st.Inherited = add(st.Inherited, k, proof, procs)
		}
	}
	for k, d := range l.descent {
		procs := make([]procKey, 0, len(d))
		for p := range d {
			procs = append(procs, p)
		}
		st.Descent = add(st.Descent, k, "", procs)
	}
	for k, t := range l.deadSince {
		st.Dead = append(st.Dead, savedDead{GPU: k.uuid, PID: k.pid, Since: t})
	}
	l.mu.Unlock()
	slices.SortFunc(st.Owners, func(a, b savedOwner) int { return b.Listed.Compare(a.Listed) })
	if len(st.Owners) > maxStateOwners {
		st.Owners = st.Owners[:maxStateOwners]
	}
	return json.Marshal(st)
}

// RestoreState fills an empty l from data that MarshalState wrote in this
// boot. A corrupt, foreign or future state is an error and changes
// nothing; the caller reports it and goes on without it.
func (l *Lineage) RestoreState(data []byte, bootID string) error {
	var st lineageState
	if err := json.Unmarshal(data, &st); err != nil {
		return fmt.Errorf("the state cannot be read: %w", err)
	}
	switch {
	case st.Version != stateVersion:
		return fmt.Errorf("the state has version %d; this build reads %d", st.Version, stateVersion)
	case bootID == "" || st.BootID != bootID:
		return fmt.Errorf("%w (written in boot %q, this is %q)", ErrForeignState, st.BootID, bootID)
	case len(st.Owners) > maxStateOwners:
		return fmt.Errorf("the state has %d owners, more than %d", len(st.Owners), maxStateOwners)
	}
	owners := map[ownerKey]*ownerEntry{}
	for _, o := range st.Owners {
		if o.GPU == "" || o.Identity.PID <= 0 {
			return fmt.Errorf("the state has an owner without a GPU or a PID")
		}
		owners[ownerKey{o.GPU, o.Identity.PID, o.Identity.StartTime}] = &ownerEntry{id: o.Identity, listed: o.Listed}
	}
	total := 0
	load := func(saved []savedDescent, proven bool) (map[ownerKey]map[procKey]string, error) {
		out := map[ownerKey]map[procKey]string{}
		for _, d := range saved {
			k := ownerKey{d.GPU, d.OwnerPID, d.OwnerStart}
			if out[k] == nil {
				out[k] = map[procKey]string{}
			}
			proof := "descent"
			if proven {
				if d.Proof != ProofDescentAtFork && d.Proof != ProofSharedOwnerFile && d.Proof != ProofSharesFile && d.Proof != ProofExecedSiblingsShare {
					return nil, fmt.Errorf("the state has inheritors proven by %q, which this build does not know", d.Proof)
				}
				proof = d.Proof
			}
			for _, p := range d.Procs {
				if p[0] == 0 || p[0] > 1<<22 { // PID_MAX_LIMIT
					return nil, fmt.Errorf("the state has a descendant with PID %d", p[0])
				}
				out[k][procKey{int(p[0]), p[1]}] = proof
				total++
			}
		}
		return out, nil
	}
	descentProofs, err := load(st.Descent, false)
	if err != nil {
		return err
	}
	inherited, err := load(st.Inherited, true)
	if err != nil {
		return err
	}
	descent := map[ownerKey]map[procKey]bool{}
	for k, d := range descentProofs {
		descent[k] = map[procKey]bool{}
		for p := range d {
			descent[k][p] = true
		}
	}
	if total > maxStateDescendants {
		return fmt.Errorf("the state has %d descendants, more than %d", total, maxStateDescendants)
	}
	dead := map[gpuPID]time.Time{}
	for _, d := range st.Dead {
		dead[gpuPID{d.GPU, d.PID}] = d.Since
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.owners.entries, l.descent, l.inherited, l.deadSince = owners, descent, inherited, dead
	l.gen++
	return nil
}

// Generation counts the changes to what l remembers that a saved state
// would miss: an owner, a descendant or a death first seen. It does not
// count the times owners are seen again.
func (l *Lineage) Generation() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.gen
}
