// Package intake receives Alertmanager's webhook notifications: it checks
// who is calling, validates the payload strictly, and records every alert
// durably before it answers, following Alertmanager's retry rules.
package intake

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"time"

	"github.com/prometheus/alertmanager/template"
)

// Message is Alertmanager's webhook payload, version 4.
type Message struct {
	*template.Data
	Version         string `json:"version"`
	GroupKey        string `json:"groupKey"`
	TruncatedAlerts uint64 `json:"truncatedAlerts"`
}

// SupportedVersion is the only payload version we accept.
const SupportedVersion = "4"

var fingerprintRE = regexp.MustCompile(`^[0-9a-f]{1,32}$`)

// PayloadError is a bad payload: Alertmanager must not retry it.
type PayloadError struct{ Msg string }

func (e *PayloadError) Error() string { return e.Msg }

func payloadErrorf(format string, args ...any) error {
	return &PayloadError{Msg: fmt.Sprintf(format, args...)}
}

// ParseMessage decodes and validates a webhook body: trailing data, a
// known field of the wrong type, a wrong version, and alerts without a
// usable identity are all rejected. Unknown fields are ignored: a newer
// Alertmanager may add some to version 4, and it does not retry a 4xx, so
// refusing them would silently stop remediation after an upgrade.
func ParseMessage(body []byte) (*Message, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	m := &Message{Data: &template.Data{}}
	if err := dec.Decode(m); err != nil {
		return nil, payloadErrorf("invalid JSON payload: %v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, payloadErrorf("invalid JSON payload: data after the top-level object")
	}
	if m.Version != SupportedVersion {
		return nil, payloadErrorf("unsupported payload version %q: this receiver speaks Alertmanager's webhook version %q", m.Version, SupportedVersion)
	}
	if m.Status != "firing" && m.Status != "resolved" {
		return nil, payloadErrorf("invalid group status %q: want firing or resolved", m.Status)
	}
	if len(m.Alerts) == 0 {
		return nil, payloadErrorf("payload has no alerts")
	}
	for i, a := range m.Alerts {
		if err := validateAlert(a); err != nil {
			return nil, payloadErrorf("alert %d: %v", i, err)
		}
	}
	return m, nil
}

func validateAlert(a template.Alert) error {
	if a.Status != "firing" && a.Status != "resolved" {
		return fmt.Errorf("invalid status %q: want firing or resolved", a.Status)
	}
	if !fingerprintRE.MatchString(a.Fingerprint) {
		return fmt.Errorf("invalid fingerprint %q: want Alertmanager's hex fingerprint", a.Fingerprint)
	}
	if a.StartsAt.IsZero() {
		return errors.New("missing startsAt")
	}
	if a.StartsAt.After(time.Now().Add(24 * time.Hour)) {
		return fmt.Errorf("startsAt %s is in the future", a.StartsAt.Format(time.RFC3339))
	}
	return nil
}
