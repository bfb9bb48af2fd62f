package config

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// bulkManifest is n Services with one EndpointSlice of eps endpoints each, as bench/scale writes.
func bulkManifest(n, eps int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "apiVersion: v1\nkind: Service\nmetadata: {name: s%d, namespace: bulk}\nspec: {clusterIP: 10.96.%d.%d, ports: [{name: http, port: 80}]}\n---\n", i, i/250, i%250+1)
		fmt.Fprintf(&b, "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s%d-1, namespace: bulk, labels: {kubernetes.io/service-name: s%d}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n", i, i)
		for e := range eps {
			fmt.Fprintf(&b, "- addresses: [\"10.245.%d.%d\"]\n", (i*eps+e)/250%250, (i*eps+e)%250+1)
		}
		b.WriteString("---\n")
	}
	return b.String()
}

// BenchmarkParseManifests decodes 10,000 Services and their EndpointSlices (50,000 endpoints)
// from one file: most of a cold start's CPU in standalone mode.
func BenchmarkParseManifests(b *testing.B) {
	file := filepath.Join(b.TempDir(), "bulk.yaml")
	if err := os.WriteFile(file, []byte(bulkManifest(10000, 5)), 0o644); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		set, err := parseManifests([]string{file}, map[string]string{file: ""}, nil)
		if err != nil || len(set.services) != 10000 {
			b.Fatalf("parse: %v (%d services)", err, len(set.services))
		}
	}
}
