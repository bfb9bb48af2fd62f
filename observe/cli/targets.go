package cli

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// target is one stream to read: the local proxy's or one node's.
type target struct {
	node   string // "" for --address
	url    string // with the query
	client *http.Client
}

// name is how messages name the target.
func (t target) name() string {
	if t.node == "" {
		return t.url
	}
	return "node " + t.node
}

// checkAddress accepts host:port (or a URL, for a proxy behind a path or on https).
func checkAddress(a string) error {
	if u, err := url.Parse(a); err == nil && u.Scheme != "" && u.Host != "" {
		return nil
	}
	if _, _, err := net.SplitHostPort(a); err != nil {
		return fmt.Errorf("%q: want host:port: %w", a, err)
	}
	return nil
}

// flowsURL is the /debug/flows URL of the proxy at hostport (or base URL).
func flowsURL(scheme, hostport string, q url.Values) string {
	u := &url.URL{Scheme: scheme, Host: hostport, Path: "/debug/flows", RawQuery: q.Encode()}
	if b, err := url.Parse(hostport); err == nil && b.Scheme != "" && b.Host != "" {
		u.Scheme, u.Host, u.Path = b.Scheme, b.Host, b.JoinPath("debug/flows").Path
	}
	return u.String()
}

// targets resolves the flags into the streams to read: the local address, or one per Node.
func (o *Options) targets(ctx context.Context, env *Env) ([]target, error) {
	if o.Node == "" && !o.AllNodes {
		rt, err := o.transport(&rest.Config{})
		if err != nil {
			return nil, err
		}
		return []target{{url: flowsURL(o.Scheme, o.Address, o.Query), client: &http.Client{Transport: rt}}}, nil
	}
	cfg, err := o.restConfig()
	if err != nil {
		return nil, err
	}
	cs, err := env.newClientset(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	rt, err := o.transport(cfg)
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: rt}
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var nodes []v1.Node
	if o.Node != "" {
		n, err := cs.CoreV1().Nodes().Get(lctx, o.Node, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get node %s: %w", o.Node, err)
		}
		nodes = []v1.Node{*n}
	} else {
		l, err := cs.CoreV1().Nodes().List(lctx, metav1.ListOptions{})
		if err != nil {
			return nil, fmt.Errorf("list nodes: %w", err)
		}
		if len(l.Items) == 0 {
			return nil, fmt.Errorf("list nodes: the cluster has none")
		}
		nodes = l.Items
	}
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].Name < nodes[j].Name })
	var ts []target
	seen := map[string]bool{} // address -> read already
	for _, n := range nodes {
		ip := nodeAddress(&n)
		if ip == "" {
			return nil, fmt.Errorf("node %s: no address in its status", n.Name)
		}
		// Two Nodes with one address (a stale Node object, a test lab's copies) are one proxy:
		// read it once, or its flows would come twice (each names its own node).
		if seen[ip] {
			continue
		}
		seen[ip] = true
		hp := net.JoinHostPort(ip, strconv.Itoa(o.Port))
		ts = append(ts, target{node: n.Name, url: flowsURL(o.Scheme, hp, o.Query), client: client})
	}
	return ts, nil
}

// nodeAddress is the Node's first InternalIP, else its first address of any type.
func nodeAddress(n *v1.Node) string {
	for _, a := range n.Status.Addresses {
		if a.Type == v1.NodeInternalIP {
			return a.Address
		}
	}
	if len(n.Status.Addresses) > 0 {
		return n.Status.Addresses[0].Address
	}
	return ""
}

// restConfig loads --kubeconfig, or $KUBECONFIG / ~/.kube/config as kubectl does.
func (o *Options) restConfig() (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = o.Kubeconfig
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	return cfg, nil
}

// transport reaches the proxies with the kubeconfig's credentials (bearer token, token file,
// client certificate, exec plugin: whatever client-go would send the API server) but with the
// proxies' own trust: their serving certificates are not the API server's, so the kubeconfig's CA
// and server name do not apply.
func (o *Options) transport(cfg *rest.Config) (http.RoundTripper, error) {
	c := rest.CopyConfig(cfg)
	c.TLSClientConfig.CAData, c.TLSClientConfig.CAFile = nil, o.CAFile
	c.TLSClientConfig.ServerName = ""
	c.TLSClientConfig.Insecure = o.Insecure
	rt, err := rest.TransportFor(c)
	if err != nil {
		return nil, fmt.Errorf("transport to the proxies: %w", err)
	}
	return rt, nil
}

func defaultClientset(cfg *rest.Config) (kubernetes.Interface, error) {
	return kubernetes.NewForConfig(cfg)
}
