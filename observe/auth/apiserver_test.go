package auth_test

// Against a real kube-apiserver (e2e/framework: etcd + kube-apiserver on loopback, authorizing
// with RBAC). The guarded handler is served by httptest on 127.0.0.1; every request goes to
// loopback only. The users of the stream are ServiceAccounts whose tokens the admin requests
// (TokenRequest), so the real service account authenticator checks them; the proxy reviews with
// the framework's proxy identity, system:kube-proxy.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	logtest "github.com/sirupsen/logrus/hooks/test"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe/auth"
)

const testNamespace = "observe-auth"

func TestAgainstAPIServer(t *testing.T) {
	cp := framework.StartControlPlane(t)
	admin := cp.AdminClient()
	ctx := t.Context()

	mustCreate(t, "namespace", func() error {
		_, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}, metav1.CreateOptions{})
		return err
	})
	for _, role := range auth.RBAC() {
		mustCreate(t, "ClusterRole "+role.Name, func() error {
			_, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{})
			return err
		})
	}
	watcher := serviceAccountToken(t, admin, "watcher")
	nobody := serviceAccountToken(t, admin, "nobody")
	watcherUser := "system:serviceaccount:" + testNamespace + ":watcher"
	bind(t, admin, "watcher-observes", auth.ObserverRole, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "watcher", Namespace: testNamespace})

	log, hook := logtest.NewNullLogger()
	authz := auth.New(auth.Config{Client: cp.ProxyClient(), Node: node, DeniedTTL: time.Second, Log: log})
	srv := httptest.NewServer(authz.Wrap(echo))
	t.Cleanup(srv.Close)
	client := &http.Client{Timeout: 30 * time.Second}
	t.Cleanup(client.CloseIdleConnections)
	do := func(token, query string) response {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/debug/flows"+query, nil)
		if err != nil {
			t.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("GET /debug/flows%s: %v", query, err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("GET /debug/flows%s: %v", query, err)
		}
		return response{code: resp.StatusCode, body: strings.TrimSpace(string(body)), header: resp.Header}
	}
	want := func(what string, got response, code int, body string) {
		t.Helper()
		if got.code != code || !strings.Contains(got.body, body) {
			t.Errorf("%s: got %d %q, want %d with %q", what, got.code, got.body, code, body)
		}
	}

	// system:kube-proxy (system:node-proxier) may not create reviews yet: the stream cannot
	// check anyone, says so once, and answers 503, not 401.
	want("before system:auth-delegator", do(watcher, ""), 503, "Service Unavailable")
	if e := hook.LastEntry(); e == nil || !strings.Contains(e.Message, "system:auth-delegator") {
		t.Errorf("log %v, want a line naming system:auth-delegator", e)
	}
	bind(t, admin, "proxy-auth-delegator", "system:auth-delegator", rbacv1.Subject{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: framework.ProxyUser})
	waitAllowed(t, admin, framework.ProxyUser, authorizationv1.ResourceAttributes{Verb: "create", Group: "authorization.k8s.io", Resource: "subjectaccessreviews"})
	waitAllowed(t, admin, framework.ProxyUser, authorizationv1.ResourceAttributes{Verb: "create", Group: "authentication.k8s.io", Resource: "tokenreviews"})
	waitAllowed(t, admin, watcherUser, authorizationv1.ResourceAttributes{Verb: "get", Resource: "nodes", Subresource: "flows", Name: node})

	got := do("", "")
	want("no token", got, 401, "Authorization: Bearer")
	if c := got.header.Get("WWW-Authenticate"); c != "Bearer" {
		t.Errorf("no token: WWW-Authenticate %q, want Bearer", c)
	}
	want("a token the API server never issued", do("not-a-token", ""), 401, "did not accept")
	want("nobody's token", do(nobody, ""), 403,
		fmt.Sprintf(`user "system:serviceaccount:%s:nobody" cannot get nodes/flows "%s"`, testNamespace, node))
	want("watcher's token", do(watcher, "?follow=1"), 200, fmt.Sprintf("flows for %s (true)", watcherUser))
	want("watcher's token with capture", do(watcher, "?follow=1&capture=1"), 403,
		fmt.Sprintf(`user %q cannot get nodes/capture "%s"`, watcherUser, node))
	if e := hook.LastEntry(); e.Message != "Flow stream: the API server answers reviews again" {
		t.Errorf("last log line %q, want the end of the failures", e.Message)
	}

	// Granted capture, the watcher gets it once its denial leaves the cache (DeniedTTL).
	bind(t, admin, "watcher-captures", auth.CaptureRole, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "watcher", Namespace: testNamespace})
	testenv.WaitFor(t, "the capture grant to reach the stream", func() bool {
		return do(watcher, "?capture=1").code == http.StatusOK
	})

	t.Run("audiences", func(t *testing.T) {
		// A token requested for the proxy's audience passes an Authorizer that asks for it; a
		// token for the API server's own audience does not.
		const audience = "kube-portal-proxy"
		forProxy := serviceAccountToken(t, admin, "watcher", audience)
		srv := httptest.NewServer(auth.New(auth.Config{Client: cp.ProxyClient(), Node: node, Audiences: []string{audience}}).Wrap(echo))
		t.Cleanup(srv.Close)
		for _, tt := range []struct {
			name, token string
			want        int
		}{
			{"token for the proxy", forProxy, 200},
			{"token for the API server", watcher, 401},
		} {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/debug/flows", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Authorization", "Bearer "+tt.token)
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.want {
				t.Errorf("%s: got %d %q, want %d", tt.name, resp.StatusCode, body, tt.want)
			}
		}
	})
}

func mustCreate(t *testing.T, what string, create func() error) {
	t.Helper()
	if err := create(); err != nil {
		t.Fatalf("create %s: %v", what, err)
	}
}

// serviceAccountToken creates the ServiceAccount name (once) and returns a token for it, for
// audiences when given (else the API server's own).
func serviceAccountToken(t *testing.T, admin kubernetes.Interface, name string, audiences ...string) string {
	t.Helper()
	ctx := t.Context()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNamespace}}
	if _, err := admin.CoreV1().ServiceAccounts(testNamespace).Get(ctx, name, metav1.GetOptions{}); err != nil {
		mustCreate(t, "ServiceAccount "+name, func() error {
			_, err := admin.CoreV1().ServiceAccounts(testNamespace).Create(ctx, sa, metav1.CreateOptions{})
			return err
		})
	}
	expiry := int64(3600)
	tr, err := admin.CoreV1().ServiceAccounts(testNamespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{Audiences: audiences, ExpirationSeconds: &expiry}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for ServiceAccount %s: %v", name, err)
	}
	return tr.Status.Token
}

func bind(t *testing.T, admin kubernetes.Interface, name, role string, subject rbacv1.Subject) {
	t.Helper()
	mustCreate(t, "ClusterRoleBinding "+name, func() error {
		_, err := admin.RbacV1().ClusterRoleBindings().Create(t.Context(), &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{subject},
		}, metav1.CreateOptions{})
		return err
	})
}

// waitAllowed waits until RBAC, which learns of new bindings through an informer, allows user
// attrs. A ServiceAccount user's groups come from its name, as the authenticator gives them.
func waitAllowed(t *testing.T, admin kubernetes.Interface, user string, attrs authorizationv1.ResourceAttributes) {
	t.Helper()
	var groups []string
	if rest, ok := strings.CutPrefix(user, "system:serviceaccount:"); ok {
		ns, _, _ := strings.Cut(rest, ":")
		groups = []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
	}
	testenv.WaitFor(t, fmt.Sprintf("%s to be allowed %s %s/%s", user, attrs.Verb, attrs.Resource, attrs.Subresource), func() bool {
		sar, err := admin.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: user, Groups: groups, ResourceAttributes: &attrs},
		}, metav1.CreateOptions{})
		return err == nil && sar.Status.Allowed
	})
}
