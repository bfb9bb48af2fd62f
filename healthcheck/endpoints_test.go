package healthcheck

import (
	"net/netip"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

// Address plan: pods 10.0.1.x run on node-a (this node), 10.0.2.x on node-b; no socket is opened.

func TestLocalReadyEndpoints(t *testing.T) {
	web := func(port string) service.ServicePortName {
		return service.ServicePortName{Namespace: "default", Name: "web", Port: port}
	}
	cart := service.ServicePortName{Namespace: "shop", Name: "cart", Port: "http"}
	ep := func(addr, node string, ready bool) service.Endpoint {
		return service.Endpoint{Addr: netip.MustParseAddrPort(addr), NodeName: node, Ready: ready, Serving: true, Terminating: !ready}
	}
	for _, tc := range []struct {
		name      string
		node      string
		endpoints map[service.ServicePortName][]service.Endpoint
		want      map[service.NamespacedName]int
	}{{
		name: "counts_local_ready_endpoints_only",
		node: "node-a",
		endpoints: map[service.ServicePortName][]service.Endpoint{
			web("http"): {ep("10.0.1.1:80", "node-a", true), ep("10.0.1.2:80", "node-a", true), ep("10.0.2.1:80", "node-b", true)},
		},
		want: map[service.NamespacedName]int{{Namespace: "default", Name: "web"}: 2},
	}, {
		name: "a_pod_on_two_ports_is_one_endpoint",
		node: "node-a",
		endpoints: map[service.ServicePortName][]service.Endpoint{
			web("http"):  {ep("10.0.1.1:80", "node-a", true)},
			web("https"): {ep("10.0.1.1:443", "node-a", true), ep("10.0.1.3:443", "node-a", true)},
		},
		want: map[service.NamespacedName]int{{Namespace: "default", Name: "web"}: 2},
	}, {
		name: "terminating_endpoints_do_not_count",
		node: "node-a",
		endpoints: map[service.ServicePortName][]service.Endpoint{
			web("http"): {ep("10.0.1.1:80", "node-a", false)},
			cart:        {ep("10.0.1.9:8080", "node-a", true), ep("10.0.1.8:8080", "node-a", false)},
		},
		want: map[service.NamespacedName]int{{Namespace: "shop", Name: "cart"}: 1},
	}, {
		name: "unknown_node_name_counts_nothing",
		node: "",
		endpoints: map[service.ServicePortName][]service.Endpoint{
			web("http"): {ep("10.0.1.1:80", "", true)},
		},
		want: map[service.NamespacedName]int{},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			if diff := cmp.Diff(tc.want, LocalReadyEndpoints(tc.node, tc.endpoints)); diff != "" {
				t.Errorf("LocalReadyEndpoints (-want +got):\n%s", diff)
			}
		})
	}
}
