package config

import (
	"strings"
	"testing"
)

// TestFastManifestJSONTakesTheCommonShape: bench/scale's and the documented manifests go the fast
// way and come out as the YAML parser's path writes them; what it cannot convert exactly is left
// to that path (ok false), never guessed.
func TestFastManifestJSONTakesTheCommonShape(t *testing.T) {
	taken := []string{
		"apiVersion: v1\nkind: Service\nmetadata: {name: s1, namespace: bulk}\nspec: {clusterIP: 10.96.0.2, ports: [{name: http, port: 80}]}\n",
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s1-1, namespace: bulk, labels: {kubernetes.io/service-name: s1}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n- addresses: [\"10.245.0.1\"]\n- addresses: ['10.245.0.2']\n  conditions:\n    ready: true\n",
		"# a comment\napiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  annotations:\n    kube-portal-proxy.io/hold-timeout: 5s\n    note: two words\nspec:\n  type: ClusterIP\n  clusterIPs:\n  - 10.96.0.10\n  ports:\n    - name: http\n      port: 80\n      targetPort: 8080\n",
		"apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: a}\n  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}], selector: {}, externalIPs: []}\n",
	}
	for _, doc := range taken {
		js, apiVersion, kind, ok := fastManifestJSON([]byte(doc))
		if !ok {
			t.Errorf("fastManifestJSON(%q) missed; want it taken", doc)
			continue
		}
		wantJS, wantAPI, wantKind, err := parsedManifestJSON([]byte(doc))
		if err != nil || string(js) != string(wantJS) || apiVersion != wantAPI || kind != wantKind {
			t.Errorf("fastManifestJSON(%q) = %s %q %q, the parser's path %s %q %q (%v)", doc, js, apiVersion, kind, wantJS, wantAPI, wantKind, err)
		}
	}
	missed := map[string]string{
		"comment_after_a_value":   "kind: Service # web\n",
		"yaml_1.1_bool":           "kind: Service\nspec: {publishNotReadyAddresses: yes}\n",
		"bool_key":                "kind: Service\nmetadata: {labels: {on: x}}\n",
		"anchor":                  "kind: &k Service\n",
		"block_scalar":            "kind: Service\nmetadata: {annotations: {a: |\n    x\n}}\n",
		"multi_line_plain_scalar": "kind: Service\nmetadata:\n  annotations:\n    a: one\n      two\n",
		"escape":                  "kind: \"Serv\\u0069ce\"\n",
		"duplicate_key":           "kind: Service\nkind: List\n",
		"float":                   "kind: Service\nspec: {ports: [{port: 8.5}]}\n",
		"octal":                   "kind: Service\nspec: {ports: [{port: 010}]}\n",
		"null_value":              "kind: Service\nmetadata:\nspec: {}\n",
		"tab":                     "kind:\tService\n",
		"non_ascii":               "kind: Service\nmetadata: {name: \"caf\xc3\xa9\"}\n",
		"flow_over_two_lines":     "kind: Service\nmetadata: {name: a,\n  namespace: b}\n",
		"bad_indentation":         "kind: Service\n  metadata: x\n",
		"sequence_document":       "- a\n- b\n",
		"empty":                   "# nothing\n",
	}
	for name, doc := range missed {
		if js, _, _, ok := fastManifestJSON([]byte(doc)); ok {
			t.Errorf("%s: fastManifestJSON(%q) took it (%s); want it left to the parser", name, doc, js)
		}
	}
}

// TestBulkManifestGoesTheFastWay: every document bench/scale writes is taken (otherwise the
// 10,000-service start pays the YAML parser again).
func TestBulkManifestGoesTheFastWay(t *testing.T) {
	for i, doc := range strings.Split(bulkManifest(20, 3), "---\n") {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		if _, _, _, ok := fastManifestJSON([]byte(doc)); !ok {
			t.Errorf("document %d missed the fast way:\n%s", i, doc)
		}
	}
}

// FuzzFastManifestJSON: whatever the fast way takes, the YAML parser's path accepts too and
// converts to the same JSON, apiVersion and kind.
func FuzzFastManifestJSON(f *testing.F) {
	for _, s := range append(servicesFileSeeds, bulkManifest(2, 2)) {
		for doc := range strings.SplitSeq(s, "\n---\n") {
			f.Add([]byte(doc))
		}
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		js, apiVersion, kind, ok := fastManifestJSON(doc)
		if !ok {
			return
		}
		wantJS, wantAPI, wantKind, err := parsedManifestJSON(doc)
		if err != nil {
			t.Fatalf("fastManifestJSON(%q) took a document the parser rejects: %v", doc, err)
		}
		if string(js) != string(wantJS) || apiVersion != wantAPI || kind != wantKind {
			t.Fatalf("fastManifestJSON(%q) = %s %q %q, the parser's path %s %q %q", doc, js, apiVersion, kind, wantJS, wantAPI, wantKind)
		}
	})
}
