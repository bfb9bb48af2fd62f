package auth

import (
	"crypto/sha256"
	"fmt"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	authenticationv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"
)

func TestCacheEvictsLeastRecentlyUsed(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(time.Unix(0, 0))
	c := newCache[string, int](clk, 2)
	c.add("a", 1, time.Minute)
	c.add("b", 2, time.Minute)
	c.get("a") // b is now the least recently used
	c.add("c", 3, time.Minute)
	var got []string
	for _, k := range []string{"a", "b", "c"} {
		if v, ok := c.get(k); ok {
			got = append(got, fmt.Sprintf("%s=%d", k, v))
		}
	}
	if diff := cmp.Diff([]string{"a=1", "c=3"}, got); diff != "" {
		t.Errorf("entries (-want +got):\n%s", diff)
	}
	if c.len() != 2 {
		t.Errorf("len = %d, want 2", c.len())
	}
}

func TestCacheExpiresAtTTL(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(time.Unix(0, 0))
	c := newCache[string, int](clk, 2)
	c.add("a", 1, time.Second)
	clk.SetTime(time.Unix(0, 0).Add(time.Second - 1))
	if _, ok := c.get("a"); !ok {
		t.Fatal("expired before its TTL")
	}
	clk.SetTime(time.Unix(1, 0))
	if _, ok := c.get("a"); ok {
		t.Fatal("still there at its TTL")
	}
	if c.len() != 0 {
		t.Errorf("an expired entry looked up stays held: len = %d", c.len())
	}
	// Adding again renews the entry.
	c.add("a", 2, time.Second)
	c.add("a", 3, time.Second)
	if v, ok := c.get("a"); !ok || v != 3 || c.len() != 1 {
		t.Errorf("get after re-add = %d, %v (len %d), want 3, true (len 1)", v, ok, c.len())
	}
}

// TestTokensKeyedByHash: the proxy's memory holds a token's SHA-256, not the token.
func TestTokensKeyedByHash(t *testing.T) {
	client := fake.NewClientset()
	client.PrependReactor("create", "tokenreviews", func(action k8stesting.Action) (bool, runtime.Object, error) {
		r := action.(k8stesting.CreateAction).GetObject().(*authenticationv1.TokenReview).DeepCopy()
		r.Status = authenticationv1.TokenReviewStatus{Authenticated: true, User: authenticationv1.UserInfo{Username: "watcher"}}
		return true, r, nil
	})
	a := New(Config{Client: client, Node: "node-1"})
	if _, ok, err := a.authenticate(t.Context(), "secret-token"); !ok || err != nil {
		t.Fatalf("authenticate = %v, %v", ok, err)
	}
	want := sha256.Sum256([]byte("secret-token"))
	for key, el := range a.tokens.items {
		if key != want {
			t.Errorf("cache key %x, want the token's SHA-256 %x", key, want)
		}
		if e := el.Value.(*entry[[sha256.Size]byte, tokenResult]); e.value.user.Name != "watcher" {
			t.Errorf("cached user %q, want watcher", e.value.user.Name)
		}
	}
	if a.tokens.len() != 1 {
		t.Errorf("%d cached tokens, want 1", a.tokens.len())
	}
}
