package intake

import (
	"bytes"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The dispatcher's requests to node agents are signed for the node they
// go to, never authenticated with the fleet's bearer token: whoever holds
// an agent's port (the agent down, a user's listener on it) learns a
// signature that is worth nothing on any other node, nothing once
// FleetWindow has passed, and nothing a second time on the node it was
// made for.
//
// The key of node N is HKDF-SHA256 of the fleet's secret (the agents'
// --auth.token-file, the dispatcher's --dispatch.token-file) with the info
// "gpu-orphan fleet request v1", a zero byte, and N. The request carries
//
//	Authorization: GPU-Orphan-Fleet-HMAC-SHA256 node=N&ts=UNIX&nonce=R&sig=HEX
//
// where sig is HMAC-SHA256, under N's key, of the scheme, the method, the
// request URI, N, ts, the nonce and the hex SHA-256 of the body, each on
// a line of its own. The agent checks the signature with the key of its
// own --node.name, ts within FleetWindow of its clock, and that it has
// not seen the nonce within the window.

// FleetScheme is the Authorization scheme of the dispatcher's signed
// requests.
const FleetScheme = "GPU-Orphan-Fleet-HMAC-SHA256"

// FleetWindow is how far a signed request's time may be from the agent's
// clock, either way; the agent remembers each nonce for as long.
const FleetWindow = 60 * time.Second

// fleetMaxBody is the largest body that a signed request may carry: the
// dispatcher's carry one alert. The body is read before the signature is
// known to be good, so that this bounds what a forged request costs.
const fleetMaxBody = 1 << 20

// fleetMaxNonces bounds the nonces an agent remembers: only requests
// signed with its key are remembered, and the dispatcher sends a few a
// second to one node. A full cache refuses signed requests rather than
// forget a nonce within the window.
const fleetMaxNonces = 1 << 16

// FleetKey is node's key, derived from the fleet's secret.
func FleetKey(secret, node string) []byte {
	return deriveKey([]byte(secret), "gpu-orphan fleet request v1\x00"+node)
}

// deriveKey is the key for info (what it signs) derived from secret:
// HKDF-SHA256, the fleet's per-node keys' and the session cookies'.
func deriveKey(secret []byte, info string) []byte {
	k, err := hkdf.Key(sha256.New, secret, nil, info, sha256.Size)
	if err != nil {
		// Only a key length beyond HKDF's bound fails.
		panic(err)
	}
	return k
}

// fleetMAC is the signature of a request under key.
func fleetMAC(key []byte, method, requestURI, node, ts, nonce string, body []byte) []byte {
	digest := sha256.Sum256(body)
	m := hmac.New(sha256.New, key)
	for _, s := range []string{FleetScheme, method, requestURI, node, ts, nonce, hex.EncodeToString(digest[:])} {
		m.Write([]byte(s))
		m.Write([]byte{'\n'})
	}
	return m.Sum(nil)
}

// SignFleetRequest signs req, whose body is body, for node's agent with the
// fleet's secret, at now, with a fresh nonce.
func SignFleetRequest(req *http.Request, body []byte, secret, node string, now time.Time) error {
	var n [18]byte
	if _, err := rand.Read(n[:]); err != nil {
		return fmt.Errorf("a nonce for the signed request: %w", err)
	}
	nonce := base64.RawURLEncoding.EncodeToString(n[:])
	ts := strconv.FormatInt(now.Unix(), 10)
	sig := fleetMAC(FleetKey(secret, node), req.Method, req.URL.RequestURI(), node, ts, nonce, body)
	v := url.Values{"node": {node}, "ts": {ts}, "nonce": {nonce}, "sig": {hex.EncodeToString(sig)}}
	req.Header.Set("Authorization", FleetScheme+" "+v.Encode())
	return nil
}

// fleetVerifier checks the dispatcher's signed requests on a node agent.
type fleetVerifier struct {
	node string
	key  []byte
	now  func() time.Time
	warn *throttledLog

	mu sync.Mutex
	// seen holds the nonces of the accepted requests, until they are
	// older than the window.
	seen      map[string]time.Time
	lastPrune time.Time
}

func newFleetVerifier(secret, node string, warn *throttledLog) *fleetVerifier {
	return &fleetVerifier{node: node, key: FleetKey(secret, node), now: time.Now, warn: warn, seen: map[string]time.Time{}}
}

// ok reports whether r is a request that the dispatcher signed for this
// node, within the window, not seen before. A nil verifier (no node name
// or no token) admits nothing. It reads r's body, and gives r a copy.
func (v *fleetVerifier) ok(r *http.Request) bool {
	if v == nil {
		return false
	}
	scheme, cred, found := strings.Cut(r.Header.Get("Authorization"), " ")
	if !found || !strings.EqualFold(scheme, FleetScheme) {
		return false
	}
	if err := v.verify(r, strings.TrimSpace(cred)); err != nil {
		v.warn.Warn("Rejected a signed fleet request", "remote", sourceOf(r), "path", r.URL.Path, "err", err)
		return false
	}
	return true
}

var errReplayed = errors.New("its nonce was used before (a replay)")

func (v *fleetVerifier) verify(r *http.Request, cred string) error {
	p, err := url.ParseQuery(cred)
	if err != nil {
		return fmt.Errorf("unreadable signature: %w", err)
	}
	node, ts, nonce, sig := p.Get("node"), p.Get("ts"), p.Get("nonce"), p.Get("sig")
	if node != v.node {
		return fmt.Errorf("signed for node %q, this is %q", node, v.node)
	}
	if nonce == "" || len(nonce) > 64 {
		return errors.New("no nonce")
	}
	want, err := hex.DecodeString(sig)
	if err != nil || len(want) != sha256.Size {
		return errors.New("no signature")
	}
	secs, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return errors.New("no time")
	}
	at, now := time.Unix(secs, 0), v.now()
	if d := now.Sub(at); d > FleetWindow || d < -FleetWindow {
		return fmt.Errorf("signed at %s, %s from this node's clock (more than %s: a replay, or the clocks differ)",
			at.UTC().Format(time.RFC3339), d.Round(time.Second), FleetWindow)
	}
	body := []byte{}
	if r.Body != nil {
		body, err = io.ReadAll(io.LimitReader(r.Body, fleetMaxBody+1))
		if err != nil {
			return fmt.Errorf("reading the body: %w", err)
		}
		r.Body.Close()
		r.Body = io.NopCloser(bytes.NewReader(body))
		if len(body) > fleetMaxBody {
			return fmt.Errorf("body over %d bytes", fleetMaxBody)
		}
	}
	if !hmac.Equal(fleetMAC(v.key, r.Method, r.RequestURI, node, ts, nonce, body), want) {
		return errors.New("wrong signature (another node's, another request's, or another fleet secret)")
	}
	return v.remember(nonce, at.Add(FleetWindow), now)
}

// remember records nonce until until, or says it was seen.
func (v *fleetVerifier) remember(nonce string, until, now time.Time) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if exp, ok := v.seen[nonce]; ok && now.Before(exp) {
		return errReplayed
	}
	if len(v.seen) >= fleetMaxNonces || now.Sub(v.lastPrune) > FleetWindow {
		for n, exp := range v.seen {
			if !now.Before(exp) {
				delete(v.seen, n)
			}
		}
		v.lastPrune = now
	}
	if len(v.seen) >= fleetMaxNonces {
		return fmt.Errorf("%d signed requests within %s: refused until some are older", len(v.seen), FleetWindow)
	}
	v.seen[nonce] = until
	return nil
}
