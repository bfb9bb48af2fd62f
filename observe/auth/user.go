package auth

import (
	"context"
	"slices"
)

// User is who the API server said a request's token belongs to.
type User struct {
	Name   string
	UID    string
	Groups []string
	// Extra carries what the authenticator added (a service account token's pod name, for one);
	// it takes part in the access review as it would in the API server's own.
	Extra map[string][]string
}

type userKey struct{}

// NewContext returns ctx carrying u, as Wrap passes it to the handler it wraps. Tests of
// handlers that log who watches use it too.
func NewContext(ctx context.Context, u User) context.Context {
	return context.WithValue(ctx, userKey{}, u)
}

// UserFrom returns the user Wrap authenticated the request as; false when the request did not
// pass through an Authorizer (a loopback-only stream is open to every local process).
func UserFrom(ctx context.Context) (User, bool) {
	u, ok := ctx.Value(userKey{}).(User)
	return u, ok
}

// clone copies u so that a cached user is never shared with a handler that could change it.
func (u User) clone() User {
	c := User{Name: u.Name, UID: u.UID, Groups: slices.Clone(u.Groups)}
	if u.Extra != nil {
		c.Extra = make(map[string][]string, len(u.Extra))
		for k, v := range u.Extra {
			c.Extra[k] = slices.Clone(v)
		}
	}
	return c
}
