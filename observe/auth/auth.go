// Package auth guards the flow stream when it is served beyond loopback: a request must carry a
// bearer token that the API server authenticates (TokenReview) and allows to get the node's
// flows, or its capture (SubjectAccessReview), as kube-rbac-proxy guards a kubelet's metrics.
// It calls the two review APIs through client-go's typed clients rather than k8s.io/apiserver's
// delegating authenticator and authorizer, which would pull in a large dependency tree for two
// API calls.
package auth

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"
)

// The attributes a request is authorized for: get on the node's flows subresource, or on its
// capture subresource when the request asks for payload. The API server serves no such
// subresources; RBAC matches rules on them all the same, as it does for the kubelet's own
// nodes/metrics and nodes/log checks.
const (
	Verb               = "get"
	Resource           = "nodes"
	SubresourceFlows   = "flows"
	SubresourceCapture = "capture"
)

// Defaults of Config.
const (
	DefaultCacheTTL  = 10 * time.Second
	DefaultDeniedTTL = 5 * time.Second
	DefaultCacheSize = 1024
)

// reviewTimeout bounds one review call: a stream request waits for it before its first byte.
const reviewTimeout = 10 * time.Second

// Config configures an Authorizer.
type Config struct {
	// Client creates the reviews; its identity needs create on tokenreviews and
	// subjectaccessreviews (the ClusterRole system:auth-delegator).
	Client kubernetes.Interface
	// Node is the name of the Node whose flows the guarded handler serves.
	Node string
	// CacheTTL is how long an accepted token and an allowed decision are reused (default 10 s):
	// a revoked permission takes effect within it.
	CacheTTL time.Duration
	// DeniedTTL is how long a rejected token and a denied decision are reused (default 5 s):
	// a newly granted permission takes effect within it.
	DeniedTTL time.Duration
	// CacheSize bounds each of the two caches, tokens and decisions (default 1024 entries).
	CacheSize int
	// Audiences, when set, are the audiences the token must be valid for.
	Audiences []string
	// Log, when set, gets one line when the reviews start failing and one when they work again.
	Log logrus.FieldLogger
	// Clock expires cache entries; nil is the real clock.
	Clock clock.PassiveClock
}

// Authorizer checks a request's bearer token and its permission with the API server.
type Authorizer struct {
	client    kubernetes.Interface
	node      string
	audiences []string
	ttl       time.Duration
	deniedTTL time.Duration
	tokens    *cache[[sha256.Size]byte, tokenResult]
	decisions *cache[[sha256.Size]byte, decision]
	health    apiHealth
}

// tokenResult is a TokenReview's answer. The cache is keyed by the token's SHA-256, so a dump of
// the proxy's memory does not hold the tokens it has seen.
type tokenResult struct {
	user          User
	authenticated bool
}

// decision is a SubjectAccessReview's answer.
type decision struct {
	allowed bool
	reason  string
}

// New returns an Authorizer for cfg. It calls nothing: the API is asked when requests come.
func New(cfg Config) *Authorizer {
	if cfg.CacheTTL <= 0 {
		cfg.CacheTTL = DefaultCacheTTL
	}
	if cfg.DeniedTTL <= 0 {
		cfg.DeniedTTL = DefaultDeniedTTL
	}
	if cfg.CacheSize <= 0 {
		cfg.CacheSize = DefaultCacheSize
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	return &Authorizer{
		client:    cfg.Client,
		node:      cfg.Node,
		audiences: cfg.Audiences,
		ttl:       cfg.CacheTTL,
		deniedTTL: cfg.DeniedTTL,
		tokens:    newCache[[sha256.Size]byte, tokenResult](cfg.Clock, cfg.CacheSize),
		decisions: newCache[[sha256.Size]byte, decision](cfg.Clock, cfg.CacheSize),
		health:    apiHealth{log: cfg.Log},
	}
}

// Wrap returns a handler that serves next only to requests whose bearer token the API server
// accepts and whose user may get the node's flows (or capture, when the query asks for it).
// next finds the user with UserFrom.
func (a *Authorizer) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := bearerToken(r.Header.Get("Authorization"))
		if !ok {
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, "Unauthorized: send an Authorization: Bearer token of a Kubernetes user", http.StatusUnauthorized)
			return
		}
		user, ok, err := a.authenticate(r.Context(), token)
		if err != nil {
			a.unavailable(w, r, err)
			return
		}
		if !ok {
			// RFC 6750 section 3.1: the token was presented and refused.
			w.Header().Set("WWW-Authenticate", `Bearer error="invalid_token"`)
			http.Error(w, "Unauthorized: the API server did not accept the bearer token", http.StatusUnauthorized)
			return
		}
		sub := SubresourceFlows
		if wantsCapture(r) {
			sub = SubresourceCapture
		}
		d, err := a.authorize(r.Context(), user, sub)
		if err != nil {
			a.unavailable(w, r, err)
			return
		}
		if !d.allowed {
			msg := fmt.Sprintf("Forbidden: user %q cannot %s %s/%s %q", user.Name, Verb, Resource, sub, a.node)
			if d.reason != "" {
				msg += ": " + d.reason
			}
			http.Error(w, msg, http.StatusForbidden)
			return
		}
		r = r.WithContext(NewContext(r.Context(), user.clone()))
		// The token has done its job; a handler that logs its request must not log it. The
		// header map is the caller's, so it is copied before the change.
		r.Header = r.Header.Clone()
		r.Header.Del("Authorization")
		next.ServeHTTP(w, r)
	})
}

// bearerToken returns the token of an "Authorization: Bearer <token>" header. The scheme is
// case-insensitive (RFC 7235); a token holds no spaces.
func bearerToken(header string) (string, bool) {
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	if token == "" || strings.ContainsAny(token, " \t") {
		return "", false
	}
	return token, true
}

// wantsCapture reports whether the request asks for payload. Any value of capture but a false
// one counts, so that a spelling the stream accepts (true, 1) never passes with flows' rights.
func wantsCapture(r *http.Request) bool {
	for _, v := range r.URL.Query()["capture"] {
		if on, err := strconv.ParseBool(v); err != nil || on {
			return true
		}
	}
	return false
}

// authenticate returns the user of token and whether the API server accepted it.
func (a *Authorizer) authenticate(ctx context.Context, token string) (User, bool, error) {
	key := sha256.Sum256([]byte(token))
	if res, ok := a.tokens.get(key); ok {
		return res.user, res.authenticated, nil
	}
	ctx, cancel := context.WithTimeout(ctx, reviewTimeout)
	defer cancel()
	review := &authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: token, Audiences: a.audiences}}
	got, err := a.client.AuthenticationV1().TokenReviews().Create(ctx, review, metav1.CreateOptions{})
	if err != nil {
		return User{}, false, fmt.Errorf("create TokenReview: %w", err)
	}
	a.health.succeeded()
	res := tokenResult{user: userOf(got.Status.User), authenticated: got.Status.Authenticated && a.audienceMatches(got.Status.Audiences)}
	a.tokens.add(key, res, a.ttlFor(res.authenticated))
	return res.user, res.authenticated, nil
}

// audienceMatches reports whether a token valid for auds serves this proxy: with Audiences
// configured, the API server must name one of them (as its webhook token authenticator checks).
func (a *Authorizer) audienceMatches(auds []string) bool {
	if len(a.audiences) == 0 {
		return true
	}
	for _, want := range a.audiences {
		for _, got := range auds {
			if got == want {
				return true
			}
		}
	}
	return false
}

// authorize asks whether user may get the node's subresource sub.
func (a *Authorizer) authorize(ctx context.Context, user User, sub string) (decision, error) {
	spec := authorizationv1.SubjectAccessReviewSpec{
		ResourceAttributes: &authorizationv1.ResourceAttributes{
			Verb: Verb, Group: "", Resource: Resource, Subresource: sub, Name: a.node,
		},
		User:   user.Name,
		UID:    user.UID,
		Groups: user.Groups,
	}
	if len(user.Extra) > 0 {
		spec.Extra = make(map[string]authorizationv1.ExtraValue, len(user.Extra))
		for k, v := range user.Extra {
			spec.Extra[k] = v
		}
	}
	// The key is the whole question: encoding/json writes map keys sorted, so equal specs
	// encode equally.
	enc, err := json.Marshal(spec)
	if err != nil {
		return decision{}, fmt.Errorf("encode SubjectAccessReview for %q: %w", user.Name, err)
	}
	key := sha256.Sum256(enc)
	if d, ok := a.decisions.get(key); ok {
		return d, nil
	}
	ctx, cancel := context.WithTimeout(ctx, reviewTimeout)
	defer cancel()
	got, err := a.client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{Spec: spec}, metav1.CreateOptions{})
	if err != nil {
		return decision{}, fmt.Errorf("create SubjectAccessReview for %q: %w", user.Name, err)
	}
	a.health.succeeded()
	d := decision{allowed: got.Status.Allowed && !got.Status.Denied, reason: got.Status.Reason}
	a.decisions.add(key, d, a.ttlFor(d.allowed))
	return d, nil
}

func (a *Authorizer) ttlFor(yes bool) time.Duration {
	if yes {
		return a.ttl
	}
	return a.deniedTTL
}

// unavailable answers a request whose review failed: the client is not at fault, so it gets 503
// (retry) rather than 401, and the proxy's log says why once per burst of failures.
func (a *Authorizer) unavailable(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() == nil {
		a.health.failed(err)
	}
	w.Header().Set("Retry-After", "5")
	http.Error(w, "Service Unavailable: the API server could not check the bearer token; try again", http.StatusServiceUnavailable)
}

func userOf(u authenticationv1.UserInfo) User {
	out := User{Name: u.Username, UID: u.UID, Groups: u.Groups}
	if len(u.Extra) > 0 {
		out.Extra = make(map[string][]string, len(u.Extra))
		for k, v := range u.Extra {
			out.Extra[k] = v
		}
	}
	return out
}

// apiHealth logs the start and the end of a run of failed reviews, not every failed request:
// with the API server down every stream request fails, and one line says it.
type apiHealth struct {
	log logrus.FieldLogger

	mu       sync.Mutex
	failing  bool
	failures int
}

func (h *apiHealth) failed(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failures++
	if h.failing || h.log == nil {
		h.failing = true
		return
	}
	h.failing = true
	msg := "Flow stream: the API server did not answer a token or access review; requests get 503 until it does"
	if apierrors.IsForbidden(err) {
		msg = "Flow stream: the proxy may not create token and access reviews (bind ClusterRole system:auth-delegator to its ServiceAccount); requests get 503"
	}
	h.log.WithError(err).Warn(msg)
}

func (h *apiHealth) succeeded() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.failing {
		return
	}
	if h.log != nil {
		h.log.WithField("failedRequests", h.failures).Info("Flow stream: the API server answers reviews again")
	}
	h.failing, h.failures = false, 0
}
