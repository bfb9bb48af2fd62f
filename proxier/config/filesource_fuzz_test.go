package config

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	clocktesting "k8s.io/utils/clock/testing"
	sigsyaml "sigs.k8s.io/yaml"
)

// servicesFileSeeds are documents to start from: the decoder tests' and the documented shapes (docs/running.md).
var servicesFileSeeds = []string{
	webYAML,
	"apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, targetPort: 8080}]}\n",
	"apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: a}\n  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}\n",
	`{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "j"}, "spec": {"clusterIP": "10.96.0.2", "ports": [{"port": 443}]}}`,
	"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: x-1, labels: {kubernetes.io/service-name: x}}\naddressType: IPv6\nendpoints: [{addresses: [\"fd00::1\"], conditions: {ready: false}}]\n",
	"apiVersion: v1\nkind: Service\nmetadata: {name: x, labels: {1: one, true: yes, 2.5: f}}\n",
	"apiVersion: v1\nkind: Service\nmetadata: {name: x\n",
	"---\n---\n# nothing\n---\nnull\n",
	"apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: eighty}]}\n",
	"- a\n- b\n",
	"apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.99}\n",
}

// lineRef is the "file:line:" an error names.
var lineRef = regexp.MustCompile(`^[^:]+:(\d+): `)

// FuzzServicesFile loads a services directory holding a good file and a file of anything
// (--services-file is written by hand or by tools). The load either applies, or is rejected with
// an error that names the bad file (and a line within it, when it names one) while the handler
// hears nothing: the last good state stays whole. An accepted file never touches the good
// file's objects.
func FuzzServicesFile(f *testing.F) {
	for _, s := range servicesFileSeeds {
		f.Add([]byte(s))
	}
	log := logrus.New()
	log.SetOutput(io.Discard)
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		good, bad := filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")
		if err := os.WriteFile(good, []byte(webYAML), 0o644); err != nil {
			t.Fatal(err)
		}
		h := &recordingHandler{}
		var loadErr error
		src := NewFileSource(dir, h, clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), time.Second, log)
		src.OnLoad = func(err error) { loadErr = err }
		src.load(true)
		if loadErr != nil {
			t.Fatalf("the good file alone: %v", loadErr)
		}
		h.take()

		if err := os.WriteFile(bad, data, 0o644); err != nil {
			t.Fatal(err)
		}
		src.load(true)
		events := h.take()
		if loadErr != nil {
			msg := loadErr.Error()
			if len(events) > 0 {
				t.Fatalf("rejected load (%v) yet the handler heard %q", loadErr, events)
			}
			if !strings.HasPrefix(msg, bad+":") && !strings.HasPrefix(msg, "read "+bad) {
				t.Fatalf("error %q does not name the file %s first", msg, bad)
			}
			if m := lineRef.FindStringSubmatch(msg); m != nil {
				lines := strings.Count(string(data), "\n") + 1
				if n, _ := strconv.Atoi(m[1]); n < 1 || n > lines {
					t.Fatalf("error %q names line %d of a file of %d lines", msg, n, lines)
				}
			}
			return
		}
		for _, e := range events {
			if strings.HasSuffix(e, " default/web") || strings.HasSuffix(e, " default/web-abc") {
				t.Fatalf("loading %s changed an object of %s: %q", bad, good, e)
			}
		}
	})
}

// FuzzDecodeDocument checks the services file's fast decoder against what it replaced (YAML to
// JSON by sigs.k8s.io/yaml, then the API machinery's universal decoder) on any document: the same
// objects, or the same error.
func FuzzDecodeDocument(f *testing.F) {
	for _, s := range servicesFileSeeds {
		for doc := range strings.SplitSeq(s, "\n---\n") {
			f.Add([]byte(doc))
		}
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		want, wantErr := oldDecode(t, doc)
		var wantObjs []apiruntime.Object
		if wantErr == nil {
			wantObjs, wantErr = flattenOld(want)
		}
		var got []decodedObj
		gotErr := decodeDocument(doc, &got)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("decodeDocument(%q) error = %v, the API machinery's %v", doc, gotErr, wantErr)
		}
		if wantErr != nil {
			// Both reject it. The messages may differ, and are not compared: the fast path keeps
			// the document's key order, so of several problems it may name another first, and the
			// JSON an error quotes differs in order and escapes (found by this target, corpus
			// files b70ee7df284a93e5, b426607fb1246c88, 10e82c34ae091559, b7548b4a58f56ad5;
			// TestDecodeDocumentMatchesTheAPIMachinery compares the messages of the usual cases).
			return
		}
		var objs []apiruntime.Object
		for _, o := range got {
			objs = append(objs, o.obj)
		}
		if diff := cmp.Diff(wantObjs, objs); diff != "" {
			t.Fatalf("decodeDocument(%q) (-API machinery +fast path):\n%s", doc, diff)
		}
	})
}

// flattenOld is the Services and EndpointSlices of an old-path object, a List's items decoded the
// old way too, or the first item's error.
func flattenOld(obj apiruntime.Object) ([]apiruntime.Object, error) {
	switch o := obj.(type) {
	case *v1.Service, *discovery.EndpointSlice:
		return []apiruntime.Object{o}, nil
	case *v1.List:
		var out []apiruntime.Object
		for _, item := range o.Items {
			js, err := sigsyaml.YAMLToJSON(item.Raw)
			if err != nil {
				return nil, err
			}
			if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
				continue
			}
			d, _, err := manifestDecoder.Decode(js, nil, nil)
			if apiruntime.IsNotRegisteredError(err) {
				continue
			}
			if err != nil {
				return nil, err
			}
			items, err := flattenOld(d)
			if err != nil {
				return nil, err
			}
			out = append(out, items...)
		}
		return out, nil
	}
	return nil, nil
}
