package config

import (
	"bytes"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/google/go-cmp/cmp"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	sigsyaml "sigs.k8s.io/yaml"
)

// oldDecode is the decoding the fast path replaced: sigs.k8s.io/yaml to JSON, then the API
// machinery's universal decoder.
func oldDecode(t *testing.T, body []byte) (apiruntime.Object, error) {
	t.Helper()
	js, err := sigsyaml.YAMLToJSON(body)
	if err != nil {
		return nil, err
	}
	if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
		return nil, nil
	}
	obj, _, err := manifestDecoder.Decode(js, nil, nil)
	if apiruntime.IsNotRegisteredError(err) {
		return nil, nil
	}
	return obj, err
}

// TestDecodeDocumentMatchesTheAPIMachinery checks that every document decodes to the object (or
// the failure) sigs.k8s.io/yaml and the universal decoder made of it.
func TestDecodeDocumentMatchesTheAPIMachinery(t *testing.T) {
	tests := []struct{ name, doc string }{
		{"service_flow_style", "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080}]}\n"},
		{"service_every_field_kind", `apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web, "yes": "no"}
  annotations:
    portal-proxy.kubernetes.io/algorithm: least-connections
    quoted: "tab\there \"q\" \\ \u00e9 \u2028 end"
    number: "80"
    multi: |
      line one
      line two
spec:
  type: LoadBalancer
  clusterIPs: [10.96.0.10, fd00::10]
  externalIPs: ["192.0.2.1"]
  ipFamilyPolicy: PreferDualStack
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
  externalTrafficPolicy: Local
  healthCheckNodePort: 30100
  loadBalancerSourceRanges: [203.0.113.0/24]
  ports:
  - {name: http, port: 80, targetPort: http, nodePort: 30080, protocol: TCP}
  - {name: dns, port: 53, targetPort: 5353, protocol: UDP}
status:
  loadBalancer: {ingress: [{ip: 198.51.100.7}]}
`},
		{"endpointslice", `apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: ["10.244.1.5"]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: node-a
  zone: z1
  hints: {forZones: [{name: z1}]}
- addresses: ["10.244.1.6"]
  conditions: {ready: false}
`},
		{"list_of_both", `apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a}
  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: a-1, labels: {kubernetes.io/service-name: a}}
  addressType: IPv4
  endpoints: [{addresses: [10.244.0.1]}]
`},
		{"json_document", `{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "j"}, "spec": {"clusterIP": "10.96.0.2", "ports": [{"port": 443}]}}`},
		{"other_kind_skipped", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec: {replicas: 2, selector: {matchLabels: {app: d}}}\n"},
		{"core_kind_not_read", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {a: b}\n"},
		{"service_of_another_group_skipped", "apiVersion: example.com/v1\nkind: Service\nmetadata: {name: s}\n"},
		{"empty", "# only a comment\n"},
		{"null", "null\n"},
		{"scalar_rejected", "just text\n"},
		{"list_at_top_rejected", "- a\n- b\n"},
		// Found by FuzzDecodeDocument (testdata/fuzz/FuzzDecodeDocument/a31f4cdf15032057): a YAML
		// sequence decodes into a yaml.MapSlice (a slice) without a type error, so "[]" was an
		// object without a kind, and a sequence of {key, value} mappings was a Service.
		{"empty_flow_list_rejected", "[]\n"},
		{"list_of_key_value_pairs_rejected", "- {key: apiVersion, value: v1}\n- {key: kind, value: Service}\n- {key: metadata, value: {name: x}}\n- {key: spec, value: {clusterIP: 10.96.0.1, ports: [{port: 80}]}}\n"},
		{"list_after_comments_rejected", "# a comment\n\n  [ ]\n"},
		{"anchored_empty_document", "&a\n"}, // FuzzDecodeDocument, 33ca7ec128f2d622: the first fix made it an error
		{"tagged_null_document", "!!null\n"},
		{"empty_mapping_rejected", "{}\n"}, // FuzzDecodeDocument, 8093511184ad3e25: was skipped as empty
		{"dash_key_is_a_mapping", "-a: 1\napiVersion: v1\nkind: Service\nmetadata: {name: x}\n"},
		{"no_kind_rejected", "apiVersion: v1\nmetadata: {name: x}\n"},
		{"wrong_type_rejected", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: eighty}]}\n"},
		{"non_string_keys", "apiVersion: v1\nkind: Service\nmetadata: {name: x, labels: {1: one, true: yes, 2.5: f}}\n"},
		{"syntax_error", "apiVersion: v1\nkind: Service\nmetadata: {name: x\n"},
		// Found by FuzzDecodeDocument: kind twice, the second (tagged) one empty. The API
		// machinery's map keeps the empty one (no kind: an error); the fast path's JSON had both
		// and the universal decoder's kind sniffing took the first (an empty List, no error).
		{"duplicate_kind_the_last_empty", "ApiVersion: v1\nkind: List\nitems:\n! kind:\n0: 000"},
		{"duplicate_key_last_wins", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: 10.96.0.1}\nspec: {clusterIP: 10.96.0.2}\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want, wantErr := oldDecode(t, []byte(tt.doc))
			var got []decodedObj
			gotErr := decodeDocument([]byte(tt.doc), &got)
			if (gotErr != nil) != (wantErr != nil) {
				t.Fatalf("error = %v, want %v", gotErr, wantErr)
			}
			if wantErr != nil {
				if gotErr.Error() != wantErr.Error() {
					t.Errorf("error = %q, want %q", gotErr, wantErr)
				}
				return
			}
			var objs []apiruntime.Object
			for _, o := range got {
				objs = append(objs, o.obj)
			}
			if diff := cmp.Diff(flatten(t, want), objs); diff != "" {
				t.Errorf("decoded objects (-want +got):\n%s", diff)
			}
		})
	}
}

// flatten is the Services and EndpointSlices of an old-path object, a List's items decoded the
// old way too.
func flatten(t *testing.T, obj apiruntime.Object) []apiruntime.Object {
	t.Helper()
	switch o := obj.(type) {
	case *v1.Service, *discovery.EndpointSlice:
		return []apiruntime.Object{o}
	case *v1.List:
		var out []apiruntime.Object
		for _, item := range o.Items {
			d, err := oldDecode(t, item.Raw)
			if err != nil {
				t.Fatalf("old decoding of a List item: %v", err)
			}
			out = append(out, flatten(t, d)...)
		}
		return out
	}
	return nil
}
