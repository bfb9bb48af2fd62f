package healthcheck

import (
	"net/netip"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// LocalReadyEndpoints counts, for each Service, its ready endpoints on the node named node: the
// value SyncEndpoints wants. As in kube-proxy, an endpoint is counted by IP across all the ports of
// its Service (a pod serving :80 and :443 is one endpoint), and a terminating endpoint is not
// counted even while it still serves, so a node with only terminating pods fails its health check
// and load balancers drain it. Services with none are left out.
func LocalReadyEndpoints(node string, endpoints map[service.ServicePortName][]service.Endpoint) map[service.NamespacedName]int {
	ips := map[service.NamespacedName]map[netip.Addr]bool{}
	for name, eps := range endpoints {
		for _, e := range eps {
			if !e.Ready || e.NodeName != node || node == "" {
				continue
			}
			svc := name.ServiceName()
			if ips[svc] == nil {
				ips[svc] = map[netip.Addr]bool{}
			}
			ips[svc][e.Addr.Addr()] = true
		}
	}
	out := make(map[service.NamespacedName]int, len(ips))
	for svc, set := range ips {
		out[svc] = len(set)
	}
	return out
}
