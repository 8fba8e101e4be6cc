package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// decodeStrict decodes data into v, rejecting what encoding/json lets
// through silently: unknown fields, trailing data, repeated fields and
// fields spelled in another case ("Mig" would set "mig"). known lists every
// field name the schema has, at any depth.
func decodeStrict(data []byte, v any, known ...string) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decoding: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("decoding: trailing data after the JSON object")
	}
	set := make(map[string]bool, len(known))
	for _, k := range known {
		set[k] = true
	}
	// The typed decode has accepted the shape, so the walk below only
	// meets well-formed, schema-deep JSON.
	if err := checkKeys(json.NewDecoder(bytes.NewReader(data)), set); err != nil {
		return fmt.Errorf("decoding: %w", err)
	}
	return nil
}

func checkKeys(dec *json.Decoder, known map[string]bool) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	delim, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	seen := map[string]bool{}
	for dec.More() {
		if delim == '{' {
			tok, err := dec.Token()
			if err != nil {
				return err
			}
			k, _ := tok.(string)
			if !known[k] {
				return fmt.Errorf("field %q: field names are lower case", k)
			}
			if seen[k] {
				return fmt.Errorf("field %q repeated", k)
			}
			seen[k] = true
		}
		if err := checkKeys(dec, known); err != nil {
			return err
		}
	}
	_, err = dec.Token() // the closing delimiter
	return err
}
