package config

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// recordingHandler logs every event as a line.
type recordingHandler struct {
	mu     sync.Mutex
	events []string
}

func (r *recordingHandler) add(format string, a ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, fmt.Sprintf(format, a...))
}

func (r *recordingHandler) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.events
	r.events = nil
	slices.Sort(out)
	return out
}

func (r *recordingHandler) OnServiceAdd(s *v1.Service) { r.add("add svc %s/%s", s.Namespace, s.Name) }
func (r *recordingHandler) OnServiceUpdate(_, s *v1.Service) {
	r.add("update svc %s/%s", s.Namespace, s.Name)
}
func (r *recordingHandler) OnServiceDelete(s *v1.Service) {
	r.add("delete svc %s/%s", s.Namespace, s.Name)
}
func (r *recordingHandler) OnServicesSynced() { r.add("services synced") }
func (r *recordingHandler) OnEndpointSliceAdd(s *discovery.EndpointSlice) {
	r.add("add slice %s/%s", s.Namespace, s.Name)
}
func (r *recordingHandler) OnEndpointSliceUpdate(_, s *discovery.EndpointSlice) {
	r.add("update slice %s/%s", s.Namespace, s.Name)
}
func (r *recordingHandler) OnEndpointSliceDelete(s *discovery.EndpointSlice) {
	r.add("delete slice %s/%s", s.Namespace, s.Name)
}
func (r *recordingHandler) OnEndpointSlicesSynced() { r.add("slices synced") }

const webYAML = `apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: 80
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
- name: http
  port: 8080
endpoints:
- addresses: ["10.244.1.1"]
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: ignored
`

// fileSourceHarness runs a FileSource on a fake clock over a temp dir.
type fileSourceHarness struct {
	dir   string
	clk   *clocktesting.FakeClock
	h     *recordingHandler
	src   *FileSource
	loads chan error
}

func newFileSourceHarness(t *testing.T, files map[string]string) *fileSourceHarness {
	t.Helper()
	fh := &fileSourceHarness{dir: t.TempDir(), clk: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)),
		h: &recordingHandler{}, loads: make(chan error, 10)}
	for name, body := range files {
		fh.write(t, name, body)
	}
	log := logrus.New()
	log.SetOutput(new(strings.Builder))
	fh.src = NewFileSource(fh.dir, fh.h, fh.clk, time.Second, log)
	fh.src.OnLoad = func(err error) { fh.loads <- err }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = fh.src.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return fh
}

func (fh *fileSourceHarness) write(t *testing.T, name, body string) {
	t.Helper()
	p := filepath.Join(fh.dir, name)
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	// Make the change visible to the stamp even within one mtime tick.
	future := time.Now().Add(time.Duration(len(body)) * time.Millisecond)
	_ = os.Chtimes(p, future, future)
}

// nextLoad waits for the next load attempt and returns its error.
func (fh *fileSourceHarness) nextLoad(t *testing.T) error {
	t.Helper()
	select {
	case err := <-fh.loads:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("no load within 5s")
		return nil
	}
}

// tick advances the fake clock past the poll interval once the source waits on it.
func (fh *fileSourceHarness) tick(t *testing.T) {
	t.Helper()
	testenv.WaitFor(t, "the file source to wait on the clock", fh.clk.HasWaiters)
	fh.clk.Step(time.Second)
}

func TestFileSource(t *testing.T) {
	fh := newFileSourceHarness(t, map[string]string{"web.yaml": webYAML})
	if err := fh.nextLoad(t); err != nil {
		t.Fatalf("initial load: %v", err)
	}
	want := []string{"add slice default/web-abc", "add svc default/web", "services synced", "slices synced"}
	if got := fh.h.take(); !slices.Equal(got, want) {
		t.Fatalf("initial events (-want +got):\n- %q\n+ %q", want, got)
	}

	// A bad document: rejected whole with file and line, nothing applied.
	fh.write(t, "web.yaml", strings.Replace(webYAML, "kind: Deployment", "kind: Service\n  spec: [", 1)+"\n")
	fh.write(t, "more.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: other}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 1}]}\n")
	fh.tick(t)
	err := fh.nextLoad(t)
	if err == nil || !strings.Contains(err.Error(), "web.yaml:") {
		t.Fatalf("bad YAML load error = %v, want one naming web.yaml and a line", err)
	}
	if got := fh.h.take(); len(got) != 0 {
		t.Fatalf("a rejected load applied events %q", got)
	}

	// Fixed: the difference from the last good state is applied.
	fh.write(t, "web.yaml", strings.Replace(webYAML, "port: 80\n", "port: 81\n", 1))
	fh.tick(t)
	if err := fh.nextLoad(t); err != nil {
		t.Fatalf("fixed load: %v", err)
	}
	want = []string{"add svc default/other", "update svc default/web"}
	if got := fh.h.take(); !slices.Equal(got, want) {
		t.Fatalf("events after fix (-want +got):\n- %q\n+ %q", want, got)
	}

	// Removing a file deletes its objects; Reload forces a read without waiting for the poll.
	if err := os.Remove(filepath.Join(fh.dir, "web.yaml")); err != nil {
		t.Fatal(err)
	}
	fh.src.Reload()
	if err := fh.nextLoad(t); err != nil {
		t.Fatalf("reload: %v", err)
	}
	want = []string{"delete slice default/web-abc", "delete svc default/web"}
	if got := fh.h.take(); !slices.Equal(got, want) {
		t.Fatalf("events after removal (-want +got):\n- %q\n+ %q", want, got)
	}
}

func TestParseManifestErrors(t *testing.T) {
	tests := []struct {
		name, body, want string
	}{
		{"yaml_syntax_line", "apiVersion: v1\nkind: Service\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: x\n   bad: indent\n", "f.yaml:"},
		{"no_name", "apiVersion: v1\nkind: Service\nspec: {clusterIP: 10.96.0.1}\n", "f.yaml:1: Service without metadata.name"},
		{"duplicate", "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: a}\n", "f.yaml:5: Service default/a defined twice"},
		{"bad_ip", "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: 10.96.0.300}\n", `f.yaml:1: Service default/a: invalid IP "10.96.0.300"`},
		// Found by FuzzServicesFile (testdata/fuzz/FuzzServicesFile/059d92ea9b26d534): the YAML
		// error at the end of a 2-line file named line 3.
		{"error_at_the_end_names_the_last_line", "0000000000: 0\n0", "f.yaml:2: yaml: line 3: could not find expected ':'"},
		{"slice_without_owner", "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s}\naddressType: IPv4\n", "f.yaml:1: endpointslice default/s: no kubernetes.io/service-name label"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "f.yaml")
			if err := os.WriteFile(p, []byte(tc.body), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := parseManifests([]string{p}, nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}
