package dispatch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"time"

	"github.com/gpu-orphan/gpu-orphan/remediate"
	"github.com/gpu-orphan/gpu-orphan/remediate/intake"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// DefaultFollowFor is how long after an alert the dispatcher keeps asking
// its agent for the result: longer than an agent keeps a young problem
// queued (twice --remediate.min-age and a minute) plus its cleanup, and
// than a short outage of the dispatcher.
const DefaultFollowFor = 6 * time.Hour

// agentResult reads the agent's webhook reply for the action it made of
// the alert with this fingerprint. It is nil when the reply does not say
// (not a gpu-orphan agent's reply): there is nothing to follow.
func agentResult(base, fingerprint, body string) *remediate.AgentResult {
	r := &remediate.AgentResult{URL: base, State: remediate.StateQueued}
	var reply intake.Reply
	if err := json.Unmarshal([]byte(body), &reply); err != nil {
		return nil
	}
	for _, o := range reply.Alerts {
		if o.Fingerprint != fingerprint {
			continue
		}
		r.ActionID = o.ActionID
		if o.ActionID == "" {
			// Ignored (another node, an unknown GPU): nothing to follow.
			r.State, r.Reason = remediate.StateSkipped, "the agent made no action of the alert: "+o.Result
			if o.Reason != "" {
				r.Reason += ": " + o.Reason
			}
		}
		return r
	}
	return nil
}

// ResultStore is where Follow finds the actions it waits for and records
// what the agents did; the store implements it.
type ResultStore interface {
	Actions(ctx context.Context, f store.Filter) ([]remediate.Action, error)
	Update(ctx context.Context, a remediate.Action) error
	AddEvent(ctx context.Context, actionID, kind string, detail any) error
}

// Follow asks, every FollowInterval until ctx ends, the agent of each
// forwarded action that has not finished for its action, and records it.
func (d *Dispatcher) Follow(ctx context.Context, st ResultStore) {
	tick := time.NewTicker(d.cfg.FollowInterval)
	defer tick.Stop()
	for {
		d.FollowOnce(ctx, st)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// FollowOnce asks once for every result still to come.
func (d *Dispatcher) FollowOnce(ctx context.Context, st ResultStore) {
	pending, err := st.Actions(ctx, store.Filter{AgentPending: true, Since: time.Now().Add(-d.cfg.FollowFor), Limit: store.MaxLimit})
	if err != nil {
		if ctx.Err() == nil {
			d.cfg.Logger.Error("Listing the actions whose agents' results are due failed", "err", err)
		}
		return
	}
	for _, a := range pending {
		if ctx.Err() != nil {
			return
		}
		updated, ended := d.collect(ctx, a)
		if reflect.DeepEqual(updated, a) {
			continue
		}
		if err := st.Update(ctx, updated); err != nil {
			d.cfg.Logger.Error("Recording an agent's result failed", "action", a.ID, "node", a.Node, "err", err)
			continue
		}
		g := updated.Agent
		switch {
		case ended != "":
			d.cfg.Logger.Warn("No longer following the agent's action: its node is on no allow-list", "action", a.ID, "node", a.Node,
				"agent_action", g.ActionID, "url", a.Agent.URL, "reason", ended)
			if err := st.AddEvent(ctx, a.ID, "agent_not_followed", map[string]any{"agent_action": g.ActionID, "url": a.Agent.URL,
				"last_state": a.Agent.State, "reason": ended}); err != nil {
				d.cfg.Logger.Error("Recording the end of a follow-up failed", "action", a.ID, "err", err)
			}
		case g.State.Final():
			d.cfg.Logger.Info("Agent finished", "action", a.ID, "node", a.Node, "agent_action", g.ActionID,
				"state", g.State, "freed_mib", updated.FreedBytes>>20, "dead_owners", len(updated.DeadOwners))
			if err := st.AddEvent(ctx, a.ID, "agent_result", map[string]any{"agent_action": g.ActionID, "state": g.State,
				"reason": g.Reason, "freed_bytes": updated.FreedBytes}); err != nil {
				d.cfg.Logger.Error("Recording an agent's result failed", "action", a.ID, "err", err)
			}
			d.escalate(ctx, st, updated)
		}
	}
}

// collect returns a with what its agent now says of its action. The agent
// is the node's as the allow-list (the targets file as it is now, and
// discovery) names it at this moment, never the URL stored when the alert
// was forwarded: a node taken off the list is not asked, and its
// follow-up ends (ended says why), and a node whose agent moved (a
// replaced pod) is asked at its new address, not at the old one, which
// another node's agent may have by now.
func (d *Dispatcher) collect(ctx context.Context, a remediate.Action) (_ remediate.Action, ended string) {
	agent := *a.Agent
	a.Agent = &agent
	base, err := d.agentBase(a.Node)
	if err != nil {
		ended = "not followed any further: " + err.Error() + "; the agent's last known state was " + string(agent.State)
		agent.State, agent.Reason, agent.Error = remediate.StateSkipped, ended, ""
		return a, ended
	}
	if base != agent.URL {
		d.cfg.Logger.Info("The node's agent moved; asking it at its current address", "action", a.ID, "node", a.Node, "from", agent.URL, "to", base)
		agent.URL = base
	}
	got, err := d.agentAction(ctx, a.Node, base, agent.ActionID)
	if err != nil {
		agent.Error = err.Error()
		return a, ""
	}
	agent.State, agent.Reason, agent.FinishedAt, agent.Error = got.State, got.Reason, got.FinishedAt, ""
	// The agent's plan and result, as it recorded them.
	a.Policy, a.GPUIndex, a.DryRun = got.Policy, got.GPUIndex, got.DryRun
	a.FreedBytes, a.VerifySeconds, a.NextStep = got.FreedBytes, got.VerifySeconds, got.NextStep
	a.Before, a.After, a.DeadOwners = got.Before, got.After, got.DeadOwners
	a.Targets, a.Excluded, a.Leftover, a.Escalation = got.Targets, got.Excluded, got.Leftover, got.Escalation
	return a, ""
}

// agentAction reads one action of node's agent: GET /api/v1/actions/{id},
// signed for node.
func (d *Dispatcher) agentAction(ctx context.Context, node, base, id string) (remediate.Action, error) {
	var a remediate.Action
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/v1/actions/"+url.PathEscape(id), nil)
	if err != nil {
		return a, err
	}
	if err := d.sign(req, nil, node); err != nil {
		return a, err
	}
	resp, err := d.cfg.Client.Do(req)
	if err != nil {
		return a, fmt.Errorf("asking the agent for action %s: %w", id, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return a, fmt.Errorf("reading the agent's action %s: %w", id, err)
	}
	if resp.StatusCode != http.StatusOK {
		return a, fmt.Errorf("the agent answered %s for action %s: %.200s", resp.Status, id, b)
	}
	if err := json.Unmarshal(b, &a); err != nil {
		return a, fmt.Errorf("the agent's action %s: %w", id, err)
	}
	if a.ID != id {
		return a, errors.New("the agent answered with action " + a.ID + " for " + id)
	}
	return a, nil
}
