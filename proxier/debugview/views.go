// Package debugview serves what the proxier shows about itself: the /debug/services and
// /debug/connections endpoints (JSON for tools, aligned text for curl) and the status page that
// renders them in a browser. The views are plain values; the proxier builds them, this package
// only renders them, so it never sees the proxier's state.
package debugview

// ServiceView is one service port as the debug endpoints and the status page show it.
type ServiceView struct {
	Name            string   `json:"name"`
	Protocol        string   `json:"protocol"`
	Port            uint16   `json:"port"`
	NodePort        uint16   `json:"nodePort,omitempty"`
	ClusterIPs      []string `json:"clusterIPs"`
	ExternalIPs     []string `json:"externalIPs,omitempty"`
	LoadBalancerIPs []string `json:"loadBalancerIPs,omitempty"`
	ProxyPort       uint16   `json:"proxyPort,omitempty"`
	// ExternalProxyPort is the socket of external traffic when a Local policy gives it its own.
	ExternalProxyPort uint16 `json:"externalProxyPort,omitempty"`
	// InternalTrafficPolicy and ExternalTrafficPolicy are Cluster or Local.
	InternalTrafficPolicy string `json:"internalTrafficPolicy"`
	ExternalTrafficPolicy string `json:"externalTrafficPolicy,omitempty"`
	// Internal and External say which endpoints each class of traffic uses on this node and why
	// (policy, topology hints, terminating fallback), and whether it is refused for lack of one.
	Internal                 *TrafficView `json:"internal,omitempty"`
	External                 *TrafficView `json:"external,omitempty"`
	HealthCheckNodePort      uint16       `json:"healthCheckNodePort,omitempty"`
	LoadBalancerSourceRanges []string     `json:"loadBalancerSourceRanges,omitempty"`
	Listen                   []string     `json:"listen,omitempty"`
	Open                     bool         `json:"open"`
	// DataPath is "proxy" (portal rules to a proxy socket) or "kernel" (kube-proxy's iptables
	// chains, no socket); "" while the port has neither (its socket failed to open).
	DataPath string `json:"dataPath,omitempty"`
	// Kernel is, for a kernel-path port, the counters of each endpoint's KUBE-SEP DNAT rule.
	Kernel   []KernelEndpointView `json:"kernel,omitempty"`
	Affinity string               `json:"affinity"`
	// Balancing is the policy the annotations ask for (portal-proxy.kubernetes.io/algorithm ...).
	Balancing BalancingView `json:"balancing"`
	// ProxyProtocol is the PROXY protocol header the port's endpoints get ("v1", "v2"; TCP).
	ProxyProtocol string `json:"proxyProtocol,omitempty"`
	// SourceMode is the address the port's endpoints see: "transparent" (the client's, where
	// the replies pass this node) or "proxy" (this node's).
	SourceMode string `json:"sourceMode,omitempty"`
	// Hold is the port's hold while it has no endpoint, when it has one (hold-timeout; TCP).
	Hold *HoldView `json:"hold,omitempty"`
	// DrainTimeout is the drain-timeout annotation ("" when unset: --drain-removed-endpoints).
	DrainTimeout string `json:"drainTimeout,omitempty"`
	// Draining lists the endpoints out of rotation whose flows wait for their drain deadline.
	Draining        []DrainView    `json:"draining,omitempty"`
	Endpoints       []EndpointView `json:"endpoints"`
	AffinityEntries []AffinityView `json:"affinityEntries,omitempty"`
	Active          int64          `json:"active"`
	Total           uint64         `json:"total"`
	BytesToEndpoint uint64         `json:"bytesToEndpoint"`
	BytesToClient   uint64         `json:"bytesToClient"`
}

// TrafficView is the endpoint selection of one class of traffic.
type TrafficView struct {
	Endpoints []string `json:"endpoints"`
	// Reason is selectEndpoints' account, e.g. "policy=Local fallback=terminating".
	Reason  string `json:"reason"`
	Refused bool   `json:"refused"`
	// Held: it has no endpoint, and new connections wait for one (hold-timeout) instead.
	Held bool `json:"held,omitempty"`
}

// EndpointView is one endpoint with its conditions and whether the balancer uses it.
type EndpointView struct {
	Address     string `json:"address"`
	Ready       bool   `json:"ready"`
	Serving     bool   `json:"serving"`
	Terminating bool   `json:"terminating"`
	InUse       bool   `json:"inUse"`
	Node        string `json:"node,omitempty"`
	Zone        string `json:"zone,omitempty"`
	// Pod is the object behind the endpoint (namespace/name, the EndpointSlice's targetRef).
	Pod string `json:"pod,omitempty"`
	// Hints are the zones and nodes the endpoint is hinted for ("zone:a", "node:n").
	Hints []string `json:"hints,omitempty"`
	// Active is the flows the balancer counts on the endpoint (dials, connections, sessions),
	// what least-connections and random-two-choices compare.
	Active int64 `json:"active"`
	// EjectedFor is how much longer outlier detection keeps it out of rotation ("" when in).
	EjectedFor string `json:"ejectedFor,omitempty"`
	// Ejections is its ejections in a row (the back-off multiplier).
	Ejections int `json:"ejections,omitempty"`
	// WarmingPercent is its share of new connections against a warm endpoint's while it warms
	// up (slow start), in percent; 0 when it is warm.
	WarmingPercent int `json:"warmingPercent,omitempty"`
}

// BalancingView is a service port's load-balancing policy.
type BalancingView struct {
	Algorithm string `json:"algorithm"`
	// The outlier detection settings, when it is on.
	OutlierConsecutiveFailures int    `json:"outlierConsecutiveFailures,omitempty"`
	OutlierEjectionTime        string `json:"outlierEjectionTime,omitempty"`
	OutlierMaxEjectionPercent  int    `json:"outlierMaxEjectionPercent,omitempty"`
	// SlowStart is the warm-up window of new and returning endpoints, when it is on.
	SlowStart string `json:"slowStart,omitempty"`
}

// HoldView is a port's hold of new connections while it has no endpoint.
type HoldView struct {
	Timeout string `json:"timeout"`
	// Limit is how many connections each of its proxy sockets holds at most.
	Limit int `json:"limit"`
	// Held is how many wait now.
	Held int64 `json:"held"`
}

// KernelEndpointView is what the kernel counted for one endpoint of a kernel-path port. The nat
// table sees the first packet of each connection only: Packets counts new connections.
type KernelEndpointView struct {
	Endpoint string `json:"endpoint"`
	Chain    string `json:"chain"`
	Packets  uint64 `json:"packets"`
	Bytes    uint64 `json:"bytes"`
}

// AffinityView is one sticky client.
type AffinityView struct {
	Client   string `json:"client"`
	Endpoint string `json:"endpoint"`
	IdleFor  string `json:"idleFor"`
}

// ConnView is one live TCP connection or UDP session.
type ConnView struct {
	Service         string `json:"service"`
	Protocol        string `json:"protocol"`
	Client          string `json:"client"`
	Endpoint        string `json:"endpoint"`
	Age             string `json:"age"`
	BytesToEndpoint uint64 `json:"bytesToEndpoint"`
	BytesToClient   uint64 `json:"bytesToClient"`
}

// DrainView is an endpoint out of rotation whose flows go on until a drain deadline.
type DrainView struct {
	Endpoint string `json:"endpoint"`
	// ClosesIn is the time left before its flows are closed.
	ClosesIn string `json:"closesIn"`
}
