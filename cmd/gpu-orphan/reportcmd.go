package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/common/model"

	"github.com/gpu-orphan/gpu-orphan/internal/cli"
	"github.com/gpu-orphan/gpu-orphan/remediate/remediateflag"
	"github.com/gpu-orphan/gpu-orphan/remediate/report"
	"github.com/gpu-orphan/gpu-orphan/remediate/store"
)

// defaultStorePath is the remediator's --store.path default.
const defaultStorePath = remediateflag.DefaultStorePath

// reportOptions are `gpu-orphan report`'s flags.
type reportOptions struct {
	since, by, output string
	storePath         string
	storeSet          bool
	url, tokenFile    string
	timeout           time.Duration
}

// runReport prints who left orphaned GPU memory, from a remediator's audit
// store or its API (a dispatcher's covers the fleet).
func runReport(o reportOptions) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := report1(ctx, o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gpu-orphan: %v\n", err)
	}
	return cli.ExitCode(err)
}

func report1(ctx context.Context, o reportOptions) error {
	since, err := model.ParseDuration(o.since)
	if err != nil || since <= 0 {
		return cli.Usagef("invalid --since %q: want a duration such as 7d, 12h or 2w", o.since)
	}
	by, err := report.ParseBy(o.by)
	if err != nil {
		return cli.Usagef("invalid --by: %w", err)
	}
	if o.url != "" && o.storeSet {
		return cli.Usagef("give --store.path or --url, not both")
	}
	if o.tokenFile != "" && o.url == "" {
		return cli.Usagef("--auth.token-file is for --url")
	}
	var src report.Source
	if o.url != "" {
		token := ""
		if o.tokenFile != "" {
			b, err := os.ReadFile(o.tokenFile)
			if err != nil {
				return fmt.Errorf("reading --auth.token-file: %w", err)
			}
			token = strings.TrimSpace(string(b))
		}
		api, err := report.NewAPISource(o.url, token, &http.Client{Timeout: o.timeout})
		if err != nil {
			return cli.Usagef("--url: %w", err)
		}
		src = api
	} else {
		st, err := store.OpenReadOnly(ctx, o.storePath)
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%w: give the remediator's --store.path, or --url of a remediator", err)
		}
		if err != nil {
			return err
		}
		defer st.Close()
		src = report.StoreSource{Store: st}
	}
	until := time.Now()
	start := until.Add(-time.Duration(since))
	actions, err := report.Collect(ctx, src, start, until)
	if err != nil {
		return err
	}
	return report.Write(os.Stdout, report.Build(actions, by, start, until), o.output)
}
