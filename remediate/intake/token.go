package intake

import (
	"fmt"
	"os"
	"strings"
)

// MinTokenLength is the shortest bearer token accepted.
const MinTokenLength = 16

// exampleTokens are the placeholder tokens that the repository ships
// (deploy/compose/token.example, the auth values of
// deploy/kubernetes/values.yaml, rendered into deploy/kubernetes/gpu-orphan.yaml).
// Anyone who has read the repository knows them.
var exampleTokens = []string{
	"gpu-orphan-example-token-replace-me-before-use",
	"REPLACE-ME-webhook-token-placeholder",
	"REPLACE-ME-agent-token-placeholder",
}

// makeToken is what the errors suggest.
const makeToken = "head -c 32 /dev/urandom | base64"

// ReadTokenFile reads a bearer token from path, the file that flag names,
// and refuses one that is too short or is a placeholder: one of the
// examples shipped in deploy/, or anything that says "replace-me". The
// error names the flag and the file, and how to make a token.
func ReadTokenFile(flag, path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", flag, err)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < MinTokenLength {
		return "", fmt.Errorf("the token in %s (%s) is %d characters long: use at least %d (for example: %s > %s)",
			path, flag, len(tok), MinTokenLength, makeToken, path)
	}
	if isExampleToken(tok) {
		return "", fmt.Errorf("the token in %s (%s) is a placeholder shipped with gpu-orphan, which anyone can read: make your own, for example: %s > %s",
			path, flag, makeToken, path)
	}
	return tok, nil
}

func isExampleToken(tok string) bool {
	for _, ex := range exampleTokens {
		if strings.EqualFold(tok, ex) {
			return true
		}
	}
	return strings.Contains(strings.ToLower(tok), "replace-me")
}
