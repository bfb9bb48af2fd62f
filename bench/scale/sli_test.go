package main

import (
	"math"
	"testing"
)

// TestSLIBuckets checks the reading of a target's network programming histogram: series of two
// label sets summed by bound, the difference of two scrapes, and the bucket holding a quantile.
func TestSLIBuckets(t *testing.T) {
	const before = `# TYPE kubeproxy_network_programming_duration_seconds histogram
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.25"} 10
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.5"} 10
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="1"} 10
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 10
kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"} 1
kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"} 10
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le="0.25"} 99
`
	const after = `kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.25"} 10
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.5"} 60
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="1"} 105
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 110
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv6",le="0.25"} 0
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv6",le="0.5"} 0
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv6",le="1"} 0
kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv6",le="+Inf"} 0
`
	b, err := parseHistogram(before, sliName)
	if err != nil {
		t.Fatal(err)
	}
	a, err := parseHistogram(after, sliName)
	if err != nil {
		t.Fatal(err)
	}
	d := a.sub(b)
	if d.count() != 100 {
		t.Fatalf("count = %v, want 100", d.count())
	}
	tests := []struct {
		q    float64
		want float64
	}{{0.5, 0.5}, {0.51, 1}, {0.95, 1}, {0.99, math.Inf(1)}}
	for _, tt := range tests {
		if got := d.bucketOf(tt.q); got != tt.want {
			t.Errorf("bucketOf(%v) = %v, want %v", tt.q, got, tt.want)
		}
	}
	if got := (histogram{}).bucketOf(0.5); !math.IsNaN(got) {
		t.Errorf("bucketOf of nothing = %v, want NaN", got)
	}
}
