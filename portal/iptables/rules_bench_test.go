package iptables

import (
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// BenchmarkBuildRules is the pure rule generation of a full sync at 10,000 service ports, the
// part of a sync that grows with the cluster.
func BenchmarkBuildRules(b *testing.B) {
	cfg := v4Config().withDefaults()
	cfg.ProtectProxyPorts = true
	specs := manySpecs(10000, 20000)
	for i := range specs {
		if i%2 == 0 {
			specs[i].NodePort = uint16(30000 + i%2000)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, errs := buildRules(cfg, portal.IPv4, specs); len(errs) > 0 {
			b.Fatal(errs)
		}
	}
}
