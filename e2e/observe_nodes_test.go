package e2e

// Watching other nodes' flows (`observe --node`, `--all-nodes`) and the token check in front of
// the exposed stream (--flows-bind-address, observe/auth), through the real binary against the
// shared API server.
//
// Address plan. TestObserveAllNodes: the two-node cluster of internal/testbed.NewCluster (node A
// 172.31.0.1, node B 172.31.0.2, pods on 10.244.x); each proxy serves its flow stream on its node
// IP, port onFlowsPort, behind token auth, and /debug/flows without a token on 127.0.0.1:10249 in
// its own namespace. The CLI runs in node A's namespace: it reaches both node IPs over the node
// link and the API server through a relay on node A's loopback. TestObserveNodeTokens: one node
// (internal/testbed.New), its stream on the node's external address 192.0.2.1:onFlowsPort, asked
// from the external host's namespace. Every packet stays inside the tests' namespaces (and the
// relays' loopback legs).

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kube-portal-proxy/kube-portal-proxy/e2e/framework"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe/auth"
)

// onFlowsPort is the proxies' --flows-bind-address port (each node namespace has its own).
const onFlowsPort = 10260

// onCLITimeout bounds one run of `observe` without --follow.
const onCLITimeout = 30 * time.Second

// onAccess is what onGrant set up: a ServiceAccount allowed to watch every node's flows (and to
// list nodes, as --all-nodes does), one allowed nothing, and their tokens.
type onAccess struct {
	watcher, nobody         string // tokens
	watcherUser, nobodyUser string
}

// onGrant gives the proxies' identity (framework.ProxyUser) system:auth-delegator, so they can
// create TokenReviews and SubjectAccessReviews, and creates in namespace the ServiceAccounts
// "watcher" (bound to the observer role of observe/auth/rbac.yaml, under a name of this test's,
// and to a role that lists nodes) and "nobody". The cluster-scoped objects are deleted when t
// ends; it returns once RBAC allows all of it.
func onGrant(t *testing.T, admin kubernetes.Interface, namespace string) onAccess {
	t.Helper()
	ctx := t.Context()
	prefix := namespace // unique per test (uniqueName)
	var roles, bindings []string
	t.Cleanup(func() {
		for _, b := range bindings {
			if err := admin.RbacV1().ClusterRoleBindings().Delete(context.Background(), b, metav1.DeleteOptions{}); err != nil {
				t.Errorf("cleanup: delete ClusterRoleBinding %s: %v", b, err)
			}
		}
		for _, r := range roles {
			if err := admin.RbacV1().ClusterRoles().Delete(context.Background(), r, metav1.DeleteOptions{}); err != nil {
				t.Errorf("cleanup: delete ClusterRole %s: %v", r, err)
			}
		}
	})
	createRole := func(role *rbacv1.ClusterRole) string {
		t.Helper()
		role.Name = prefix + "-" + role.Name
		if _, err := admin.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create ClusterRole %s: %v", role.Name, err)
		}
		roles = append(roles, role.Name)
		return role.Name
	}
	bind := func(name, role string, subject rbacv1.Subject) {
		t.Helper()
		crb := &rbacv1.ClusterRoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: prefix + "-" + name},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{subject},
		}
		if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create ClusterRoleBinding %s: %v", crb.Name, err)
		}
		bindings = append(bindings, crb.Name)
	}

	var observer string
	for _, role := range auth.RBAC() {
		name := createRole(role)
		if strings.HasSuffix(name, auth.ObserverRole) {
			observer = name
		}
	}
	nodeReader := createRole(&rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "node-reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list"}}},
	})
	a := onAccess{
		watcher: onServiceAccountToken(t, admin, namespace, "watcher"), watcherUser: "system:serviceaccount:" + namespace + ":watcher",
		nobody: onServiceAccountToken(t, admin, namespace, "nobody"), nobodyUser: "system:serviceaccount:" + namespace + ":nobody",
	}
	watcher := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: "watcher", Namespace: namespace}
	bind("proxy-auth-delegator", "system:auth-delegator", rbacv1.Subject{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: framework.ProxyUser})
	bind("watcher-observes", observer, watcher)
	bind("watcher-lists-nodes", nodeReader, watcher)

	onWaitAllowed(t, admin, framework.ProxyUser, authorizationv1.ResourceAttributes{Verb: "create", Group: "authentication.k8s.io", Resource: "tokenreviews"})
	onWaitAllowed(t, admin, framework.ProxyUser, authorizationv1.ResourceAttributes{Verb: "create", Group: "authorization.k8s.io", Resource: "subjectaccessreviews"})
	onWaitAllowed(t, admin, a.watcherUser, authorizationv1.ResourceAttributes{Verb: "get", Resource: "nodes", Subresource: auth.SubresourceFlows, Name: "any"})
	onWaitAllowed(t, admin, a.watcherUser, authorizationv1.ResourceAttributes{Verb: "list", Resource: "nodes"})
	return a
}

// onServiceAccountToken creates the ServiceAccount name in namespace and returns a token for it
// (TokenRequest, the API server's own audience).
func onServiceAccountToken(t *testing.T, admin kubernetes.Interface, namespace, name string) string {
	t.Helper()
	ctx := t.Context()
	sas := admin.CoreV1().ServiceAccounts(namespace)
	if _, err := sas.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ServiceAccount %s/%s: %v", namespace, name, err)
	}
	expiry := int64(3600)
	tr, err := sas.CreateToken(ctx, name, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for ServiceAccount %s/%s: %v", namespace, name, err)
	}
	return tr.Status.Token
}

// onWaitAllowed waits until RBAC (which learns of new bindings through an informer) allows user
// attrs. A ServiceAccount's groups follow from its name, as the authenticator gives them.
func onWaitAllowed(t *testing.T, admin kubernetes.Interface, user string, attrs authorizationv1.ResourceAttributes) {
	t.Helper()
	var groups []string
	if rest, ok := strings.CutPrefix(user, "system:serviceaccount:"); ok {
		ns, _, _ := strings.Cut(rest, ":")
		groups = []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
	}
	eventually(t, 30*time.Second, fmt.Sprintf("RBAC never allowed %s %s %s/%s", user, attrs.Verb, attrs.Resource, attrs.Subresource), func() error {
		sar, err := admin.AuthorizationV1().SubjectAccessReviews().Create(t.Context(), &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: user, Groups: groups, ResourceAttributes: &attrs},
		}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		if !sar.Status.Allowed {
			return fmt.Errorf("denied: %s", sar.Status.Reason)
		}
		return nil
	})
}

// onWriteKubeconfig writes a kubeconfig that reaches the API server at server (a relay's
// https://address) with token: the proxy's kubeconfig (for the cluster and its CA) with its
// credentials replaced.
func onWriteKubeconfig(t *testing.T, path, server, token string) {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(controlPlane.ProxyKubeconfig)
	if err != nil {
		t.Fatalf("read %s: %v", controlPlane.ProxyKubeconfig, err)
	}
	for _, c := range cfg.Clusters {
		c.Server = server
	}
	for _, ai := range cfg.AuthInfos {
		ai.Token, ai.TokenFile = token, ""
		ai.ClientCertificate, ai.ClientCertificateData, ai.ClientKey, ai.ClientKeyData = "", nil, "", nil
	}
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// onCluster is a two-node cluster whose proxies expose their flow streams on their node IPs, and
// a kubeconfig for the watcher that works from node A's namespace.
type onCluster struct {
	*twoNodes
	access     onAccess
	kubeconfig string // the watcher's, through the relay on node A
}

// onNewCluster is newTwoNodes with each proxy also serving /debug/flows on <node IP>:onFlowsPort
// behind token auth, and the watcher's kubeconfig through node A's relay.
func onNewCluster(t *testing.T) *onCluster {
	t.Helper()
	c := &onCluster{}
	c.twoNodes = newTwoNodesWith(t, func(tn *twoNodes, i int, n *node, relay, dir string) []string {
		if i == 0 {
			c.access = onGrant(t, tn.admin, tn.namespace)
			c.kubeconfig = filepath.Join(dir, "watcher.kubeconfig")
			onWriteKubeconfig(t, c.kubeconfig, "https://"+relay, c.access.watcher)
		}
		return []string{fmt.Sprintf("--flows-bind-address=%s:%d", n.IP, onFlowsPort)}
	})
	return c
}

// onFlow is one flow item of the CLI's -o json output, with the line it came from.
type onFlow struct {
	*observe.Flow
	line string
}

// onParse reads the CLI's -o json output: every line must be an item; it returns the flows.
func onParse(t *testing.T, out string) []onFlow {
	t.Helper()
	var flows []onFlow
	for line := range strings.Lines(out) {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		var it observe.Item
		if err := json.Unmarshal([]byte(line), &it); err != nil {
			t.Fatalf("observe -o json printed %q, not an item: %v", line, err)
		}
		if it.Flow != nil {
			flows = append(flows, onFlow{it.Flow, line})
		}
	}
	return flows
}

// onObserve runs `kube-portal-proxy observe args...` in ns to its end and returns its stdout and
// stderr; it fails t if the command fails.
func onObserve(t *testing.T, ns *netns.NS, args ...string) (stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), onCLITimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns.Name, proxyBinary, "observe"}, args...)...)
	var out, errOut strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("observe %s: %v; stderr:\n%s", strings.Join(args, " "), err, errOut.String())
	}
	return out.String(), errOut.String()
}

// onDedupe keeps the first of each (node, flow ID, phase). Other tests' Node objects may share
// this cluster's node IPs (every two-node cluster uses 172.31.0.1 and .2, each in its own
// namespaces), and from node A's namespace those addresses are this test's proxies: --all-nodes
// then reads them twice, under the other Nodes' names, with the same node field.
func onDedupe(flows []onFlow) []onFlow {
	type key struct {
		node  string
		id    uint64
		phase string
	}
	seen := map[key]bool{}
	var out []onFlow
	for _, f := range flows {
		k := key{f.Node, f.ID, f.Phase}
		if !seen[k] {
			seen[k] = true
			out = append(out, f)
		}
	}
	return out
}

// onCheckOrdered fails t unless the flows are in time order.
func onCheckOrdered(t *testing.T, what string, flows []onFlow) {
	t.Helper()
	for i := 1; i < len(flows); i++ {
		if flows[i].Time.Before(flows[i-1].Time) {
			t.Errorf("%s: flow %d (%s) is earlier than flow %d (%s)", what, i, flows[i].line, i-1, flows[i-1].line)
		}
	}
}

// onByNode counts the flows per node.
func onByNode(flows []onFlow) map[string]int {
	n := map[string]int{}
	for _, f := range flows {
		n[f.Node]++
	}
	return n
}

// TestObserveAllNodes: two nodes, each proxy exposing its flow stream on its node IP behind
// token auth; a ServiceAccount allowed get nodes/flows (rbac.yaml's observer role) and list
// nodes. A pod on each node sends requests to one Service (endpoints on both nodes). Run in node
// A's namespace with the ServiceAccount's kubeconfig, `observe --all-nodes` shows the flows of both
// nodes merged in time order, each flow named by the node whose proxy saw it (its client is that
// node's pod); --last N keeps the last N of the merged stream; --node B shows B's alone; and
// --follow shows new flows of both nodes as they happen.
func TestObserveAllNodes(t *testing.T) {
	t.Parallel()
	c := onNewCluster(t)
	a, b := c.nodes[0], c.nodes[1]
	svc := c.service(t, "svc-observe", tcpService(corev1.ServiceTypeClusterIP, 80, 8080))
	eps := []endpoint{podEndpoint(a, a.backend(), readyPod), podEndpoint(b, b.backend(), readyPod)}
	c.setSlice(t, svc, eps...)
	c.waitSynced(t, svc, eps...)

	// Three requests from each node's client pod, alternating, so the newest flows are of both.
	const perNode = 3
	for range perNode {
		for _, n := range c.nodes {
			if _, err := whoTCP(n.client().NS, clusterIP(svc, 0)); err != nil {
				t.Fatalf("%s -> %s: %v", n.client().Name, clusterIP(svc, 0), err)
			}
		}
	}
	common := []string{"--kubeconfig=" + c.kubeconfig, fmt.Sprintf("--port=%d", onFlowsPort), "-o", "json", "--namespace=" + c.namespace}
	clientOf := map[string]netip.Addr{a.name: a.client().IP, b.name: b.client().IP}
	backends := []string{netip.AddrPortFrom(a.backend().IP, 8080).String(), netip.AddrPortFrom(b.backend().IP, 8080).String()}
	checkFlow := func(what string, f onFlow) {
		t.Helper()
		want, ok := clientOf[f.Node]
		switch {
		case !ok:
			t.Errorf("%s: a flow of node %q, not of this cluster: %s", what, f.Node, f.line)
		case f.Service != svc.Name || f.Phase != "end" || f.Verdict != "forwarded" || !slices.Contains(backends, f.Endpoint):
			t.Errorf("%s: want an ended, forwarded flow of %s to a backend pod: %s", what, svc.Name, f.line)
		case netip.MustParseAddrPort(f.Client).Addr() != want:
			t.Errorf("%s: node %s's flow is from %s, want its own client pod %s: %s", what, f.Node, f.Client, want, f.line)
		}
	}

	// The end events are recorded as the connections finish, just after the clients read.
	var all []onFlow
	eventually(t, 10*time.Second, "observe --all-nodes never showed every request", func() error {
		out, stderr := onObserve(t, a.NS, append(common, "--all-nodes")...)
		raw := onParse(t, out)
		onCheckOrdered(t, "--all-nodes", raw)
		all = onDedupe(raw)
		if got := onByNode(all); got[a.name] != perNode || got[b.name] != perNode {
			return fmt.Errorf("flows per node %v, want %d of %s and of %s; stderr:\n%s", got, perNode, a.name, b.name, stderr)
		}
		return nil
	})
	for _, f := range all {
		checkFlow("--all-nodes", f)
	}

	out, _ := onObserve(t, a.NS, append(common, "--all-nodes", "--last=4")...)
	last := onParse(t, out)
	onCheckOrdered(t, "--all-nodes --last=4", last)
	if len(last) != 4 {
		t.Errorf("--all-nodes --last=4 printed %d flows, want 4:\n%s", len(last), out)
	}
	if got := onByNode(last); got[a.name] == 0 || got[b.name] == 0 {
		t.Errorf("--all-nodes --last=4: flows per node %v, want the newest of both nodes:\n%s", got, out)
	}
	for _, f := range last {
		checkFlow("--all-nodes --last=4", f)
		if f.Time.Before(all[len(all)-4].Time) {
			t.Errorf("--all-nodes --last=4 printed %s, older than the 4 newest flows", f.line)
		}
	}

	out, _ = onObserve(t, a.NS, append(common, "--node="+b.name)...)
	one := onParse(t, out)
	if got := onByNode(one); len(got) != 1 || got[b.name] != perNode {
		t.Errorf("--node=%s: flows per node %v, want %d of %s alone:\n%s", b.name, got, perNode, b.name, out)
	}
	for _, f := range one {
		checkFlow("--node", f)
	}

	onFollowBoth(t, c, svc, common)
}

// onFollowBoth runs `observe --all-nodes --follow --last=0` and sends a request from each node's
// client pod per round until the stream has shown a new flow of each node (at most 10 rounds,
// each waiting a second for the lines).
func onFollowBoth(t *testing.T, c *onCluster, svc *corev1.Service, common []string) {
	t.Helper()
	a := c.nodes[0]
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	args := append([]string{"netns", "exec", a.NS.Name, proxyBinary, "observe"}, append(common, "--all-nodes", "--follow", "--last=0")...)
	cmd := exec.CommandContext(ctx, "ip", args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("observe --follow: %v", err)
	}
	lines := make(chan string)
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			case <-ctx.Done():
				return
			}
		}
	}()
	defer func() {
		cancel() // kills the CLI (ip netns exec execs it), which ends the reader
		<-readDone
		if err := cmd.Wait(); err != nil && ctx.Err() == nil {
			t.Errorf("observe --follow: %v; stderr:\n%s", err, stderr.String())
		}
	}()

	seen := map[string]int{}
	var got []string
	for round := 0; round < 10 && (seen[c.nodes[0].name] == 0 || seen[c.nodes[1].name] == 0); round++ {
		for _, n := range c.nodes {
			if _, err := whoTCP(n.client().NS, clusterIP(svc, 0)); err != nil {
				t.Fatalf("%s -> %s: %v", n.client().Name, clusterIP(svc, 0), err)
			}
		}
		wait := time.NewTimer(time.Second)
	read:
		for {
			select {
			case line := <-lines:
				got = append(got, line)
				for _, f := range onParse(t, line) {
					if f.Service == svc.Name && f.Phase == "end" {
						seen[f.Node]++
					}
				}
			case <-wait.C:
				break read
			case <-readDone:
				wait.Stop()
				t.Fatalf("observe --follow ended: stderr:\n%s", stderr.String())
			}
		}
	}
	if seen[c.nodes[0].name] == 0 || seen[c.nodes[1].name] == 0 {
		t.Errorf("observe --all-nodes --follow: new flows per node %v, want both nodes; output:\n%s\nstderr:\n%s", seen, strings.Join(got, "\n"), stderr.String())
	}
}

// TestObserveNodeTokens: the exposed stream (--flows-bind-address on the node's external
// address) through the real daemon and API server: no token is 401; a ServiceAccount without the
// grant is 403 naming it; one bound to rbac.yaml's observer role gets 200 and the stream (with the
// flow it made); capture=1 needs nodes/capture too, so the same token gets 403 (with capture
// enabled on the proxy, so the refusal is the grant's); the address serves nothing but
// /debug/flows; and the metrics address on the node's loopback still serves /debug/flows with no
// token.
func TestObserveNodeTokens(t *testing.T) {
	t.Parallel()
	n := newClusterNode(t, 1)
	access := onGrant(t, n.admin, n.namespace)
	svc := n.createService(t, "web", webSpec(corev1.ServiceTypeClusterIP))
	n.setEndpoints(t, svc, 1)
	flowsAddr := netip.AddrPortFrom(testbed.NodeExtIP, onFlowsPort)
	proxy := n.startProxy(t, "--flows-bind-address="+flowsAddr.String(), "--flow-capture")
	tg := targetsOf(t, svc)
	proxy.waitAnswers(t, n.bed.Client, tg.clusterTCP, "the cluster IP portal never answered")

	remote := "http://" + flowsAddr.String()
	get := func(ns *netns.NS, url, token string) (int, string) {
		t.Helper()
		code, body, err := onGet(t.Context(), ns, url, token)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		return code, body
	}
	wantFlows := func(what, body string) {
		t.Helper()
		for _, f := range onParse(t, body) {
			if f.Namespace == n.namespace && f.Service == svc.Name && f.Node == n.name {
				return
			}
		}
		t.Errorf("%s: no flow of %s/%s on %s in the stream:\n%s", what, n.namespace, svc.Name, n.name, body)
	}
	for _, tt := range []struct {
		what, path, token string
		code              int
		body              string
	}{
		{"no token", "/debug/flows", "", http.StatusUnauthorized, "Authorization: Bearer"},
		{"a token the API server never issued", "/debug/flows", "not-a-token", http.StatusUnauthorized, ""},
		{"a token without the grant", "/debug/flows", access.nobody, http.StatusForbidden,
			fmt.Sprintf(`user %q cannot get nodes/flows %q`, access.nobodyUser, n.name)},
		{"the observer's token", "/debug/flows", access.watcher, http.StatusOK, ""},
		{"the observer's token, capture=1", "/debug/flows?capture=1", access.watcher, http.StatusForbidden,
			fmt.Sprintf(`user %q cannot get nodes/capture %q`, access.watcherUser, n.name)},
		{"the observer's token, another path", "/metrics", access.watcher, http.StatusNotFound, ""},
	} {
		code, body := get(n.bed.External, remote+tt.path, tt.token)
		if code != tt.code || !strings.Contains(body, tt.body) {
			t.Errorf("%s: GET %s = %d %q, want %d with %q", tt.what, tt.path, code, body, tt.code, tt.body)
		}
		if code == http.StatusOK && tt.path == "/debug/flows" {
			wantFlows(tt.what, body)
		}
	}

	code, body := get(n.bed.Node, "http://"+metricsAddr+"/debug/flows", "")
	if code != http.StatusOK {
		t.Fatalf("the metrics address on loopback: GET /debug/flows = %d %q, want 200 without a token", code, body)
	}
	wantFlows("the metrics address, no token", body)
}

// onGet fetches url from inside ns with a bearer token ("" for none), without following the
// stream (no follow=1: the proxy sends its ring and ends).
func onGet(ctx context.Context, ns *netns.NS, url, token string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := nodeHTTP(ns).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil && !errors.Is(err, io.EOF) {
		return resp.StatusCode, string(body), err
	}
	return resp.StatusCode, string(body), nil
}
