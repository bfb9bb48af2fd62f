package config

import (
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	clocktesting "k8s.io/utils/clock/testing"
)

// objectsHandler keeps every object it is given, in the order given.
type objectsHandler struct{ objs map[string]apiruntime.Object }

func (o *objectsHandler) OnServiceAdd(s *v1.Service)       { o.objs["s/"+s.Namespace+"/"+s.Name] = s }
func (o *objectsHandler) OnServiceUpdate(_, s *v1.Service) { o.OnServiceAdd(s) }
func (o *objectsHandler) OnServiceDelete(*v1.Service)      {}
func (o *objectsHandler) OnServicesSynced()                {}
func (o *objectsHandler) OnEndpointSliceAdd(s *discovery.EndpointSlice) {
	o.objs["e/"+s.Namespace+"/"+s.Name] = s
}
func (o *objectsHandler) OnEndpointSliceUpdate(_, s *discovery.EndpointSlice) {
	o.OnEndpointSliceAdd(s)
}
func (o *objectsHandler) OnEndpointSliceDelete(*discovery.EndpointSlice) {}
func (o *objectsHandler) OnEndpointSlicesSynced()                        {}

// richDocument sets every field of a Service and an EndpointSlice that the proxier reads, and
// more: pointers set to zero values, empty objects, a named target port, timestamps.
const richDocument = `apiVersion: v1
kind: Service
metadata:
  name: rich
  namespace: shop
  labels: {app: rich}
  annotations:
    portal-proxy.kubernetes.io/access-log: "true"
    endpoints.kubernetes.io/last-change-trigger-time: "2026-11-28T02:00:00.123456Z"
  creationTimestamp: "2026-11-28T01:00:00Z"
  deletionTimestamp: "2026-11-28T01:30:00Z"
  uid: 8d0f6c2e-0000-4000-8000-000000000001
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20, "fd00::20"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: PreferDualStack
  externalIPs: [192.0.2.1]
  loadBalancerSourceRanges: [198.51.100.0/24]
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  healthCheckNodePort: 30001
  publishNotReadyAddresses: false
  allocateLoadBalancerNodePorts: false
  trafficDistribution: PreferClose
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}
  selector: {}
  ports:
  - {name: http, port: 80, targetPort: web, nodePort: 30080, protocol: TCP, appProtocol: http}
  - {name: dns, port: 53, targetPort: 5353, protocol: UDP}
status:
  loadBalancer:
    ingress: [{ip: 203.0.113.1, ipMode: Proxy, ports: [{port: 80, protocol: TCP}]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: rich-1
  namespace: shop
  labels: {kubernetes.io/service-name: rich}
  annotations: {endpoints.kubernetes.io/last-change-trigger-time: "2026-11-28T02:00:00Z"}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP, appProtocol: http}
- {name: "", port: 0}
- {}
endpoints:
- addresses: [10.244.0.1]
  conditions: {ready: false, serving: true, terminating: true}
  hostname: a
  nodeName: node-1
  zone: z1
  hints: {forZones: [{name: z1}], forNodes: [{name: node-1}]}
  targetRef: {kind: Pod, namespace: shop, name: rich-a, uid: 8d0f6c2e-0000-4000-8000-000000000002}
  deprecatedTopology: {a: b}
- addresses: [10.244.0.2]
  conditions: {}
  hints: {}
- addresses: []
`

// TestHandedOverAsDecoded: the objects a load hands over are those decoded from the file (with
// their namespace defaulted and a Service's clusterIPs filled in), though the load keeps them
// encoded until their turn. Protobuf does not tell an empty list or map from none; no reader of
// these objects does either (they ask len).
func TestHandedOverAsDecoded(t *testing.T) {
	if n := checkHandedOver(t, richDocument); n != 2 {
		t.Fatalf("the rich document handed over %d objects; want 2 (is it still accepted?)", n)
	}
	for _, doc := range servicesFileSeeds {
		checkHandedOver(t, doc)
	}
}

// checkHandedOver loads doc when it decodes and compares what is handed over with what was
// decoded, returning how many objects were; 0 for a rejected doc.
func checkHandedOver(t *testing.T, doc string) int {
	t.Helper()
	var want []decodedObj
	for _, d := range splitDocuments([]byte(doc)) {
		if err := decodeDocument(d.body, &want); err != nil {
			return 0 // rejected: nothing is handed over
		}
	}
	wantObjs := map[string]apiruntime.Object{}
	for _, o := range want {
		p := prepare(o) // defaults the object as a load does
		if p.keyErr != nil || p.err != nil {
			return 0
		}
		prefix := "e/"
		if p.service {
			prefix = "s/"
		}
		if _, dup := wantObjs[prefix+p.key]; dup {
			return 0
		}
		wantObjs[prefix+p.key] = o.obj
	}
	file := filepath.Join(t.TempDir(), "f.yaml")
	if err := os.WriteFile(file, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	log := logrus.New()
	log.SetOutput(io.Discard)
	h := &objectsHandler{objs: map[string]apiruntime.Object{}}
	var loadErr error
	src := NewFileSource(file, h, clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), time.Second, log)
	src.OnLoad = func(err error) { loadErr = err }
	src.load(true)
	if loadErr != nil {
		t.Fatalf("load of %q: %v", doc, loadErr)
	}
	if diff := cmp.Diff(wantObjs, h.objs, cmpopts.EquateEmpty()); diff != "" {
		t.Errorf("handed over from %q (-decoded +handed over):\n%s", firstLine(doc), diff)
	}
	return len(h.objs)
}

func firstLine(s string) string { l, _, _ := strings.Cut(s, "\n"); return l }

// FuzzHandedOverAsDecoded is TestHandedOverAsDecoded on any file.
func FuzzHandedOverAsDecoded(f *testing.F) {
	f.Add([]byte(richDocument))
	for _, s := range servicesFileSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) { checkHandedOver(t, string(data)) })
}

// deletesHandler keeps the objects of deletion events.
type deletesHandler struct {
	tallyHandler
	deleted []apiruntime.Object
}

func (d *deletesHandler) OnServiceDelete(s *v1.Service) { d.deleted = append(d.deleted, s) }
func (d *deletesHandler) OnEndpointSliceDelete(s *discovery.EndpointSlice) {
	d.deleted = append(d.deleted, s)
}

// TestDeletionNamesTheObject: an object gone from the file is deleted by its namespace and name
// (and an EndpointSlice with its Service), though the source keeps them only as one key, even
// where a slash in a name or namespace makes the key ambiguous.
func TestDeletionNamesTheObject(t *testing.T) {
	file := filepath.Join(t.TempDir(), "f.yaml")
	write := func(body string) {
		if err := os.WriteFile(file, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(`apiVersion: v1
kind: Service
metadata: {name: c, namespace: a/b}
---
apiVersion: v1
kind: Service
metadata: {name: b/c, namespace: x}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s/1, namespace: a/b, labels: {kubernetes.io/service-name: c}}
addressType: IPv4
`)
	log := logrus.New()
	log.SetOutput(io.Discard)
	h := &deletesHandler{}
	var loadErr error
	src := NewFileSource(file, h, clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), time.Second, log)
	src.OnLoad = func(err error) { loadErr = err }
	src.load(true)
	if loadErr != nil {
		t.Fatal(loadErr)
	}
	write("")
	src.load(true)
	if loadErr != nil {
		t.Fatal(loadErr)
	}
	got := map[string]bool{}
	for _, o := range h.deleted {
		switch o := o.(type) {
		case *v1.Service:
			got["svc ns="+o.Namespace+" name="+o.Name] = true
		case *discovery.EndpointSlice:
			got["slice ns="+o.Namespace+" name="+o.Name+" owner="+o.Labels[discovery.LabelServiceName]] = true
		}
	}
	want := map[string]bool{"svc ns=a/b name=c": true, "svc ns=x name=b/c": true, "slice ns=a/b name=s/1 owner=c": true}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("deletions (-want +got):\n%s", diff)
	}
}

// orderHandler records the kind of each add, in order.
type orderHandler struct {
	tallyHandler
	kinds []string
}

func (o *orderHandler) OnServiceAdd(*v1.Service) { o.kinds = append(o.kinds, "service") }
func (o *orderHandler) OnEndpointSliceAdd(*discovery.EndpointSlice) {
	o.kinds = append(o.kinds, "slice")
}

// TestLoadHandsOverSlicesFirst: a load hands over the EndpointSlices before the Services, so the
// proxier selects each Service's endpoints once, with its slices there.
func TestLoadHandsOverSlicesFirst(t *testing.T) {
	file := filepath.Join(t.TempDir(), "f.yaml")
	if err := os.WriteFile(file, []byte(bulkManifest(20, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	log := logrus.New()
	log.SetOutput(io.Discard)
	h := &orderHandler{}
	NewFileSource(file, h, clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)), time.Second, log).load(true)
	want := append(slices.Repeat([]string{"slice"}, 20), slices.Repeat([]string{"service"}, 20)...)
	if !slices.Equal(h.kinds, want) {
		t.Errorf("hand-over order %q; want the 20 slices, then the 20 services", h.kinds)
	}
}
