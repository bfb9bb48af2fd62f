package daemon

// Address plan: everything real is on loopback. The echo backend listens on 127.0.0.1:<ephemeral>,
// the proxy sockets on 127.0.0.1:<kernel-chosen> (--bind-address 127.0.0.1, which validation
// refuses for real portals because they cannot DNAT to loopback; the fake portals here do not
// DNAT), /healthz on 127.0.0.1:0 and /metrics on 127.0.0.2:0. Cluster IPs 10.96.0.x only appear
// in portal specs and are never contacted. No root needed: the host, the portals' iptables and
// the clock are fakes.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
	"github.com/kube-portal-proxy/kube-portal-proxy/portal/iptables"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

const waitFor = 10 * time.Second

// fakeHost records the tuning and checks instead of doing them.
type fakeHost struct {
	mu                     sync.Mutex
	tuned, checks, settled int
	checkErr               error
}

func (h *fakeHost) tune(*Options, logrus.FieldLogger) func() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.tuned++
	return func() { h.mu.Lock(); h.settled++; h.mu.Unlock() }
}
func (h *fakeHost) check(*Options) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.checks++
	return h.checkErr
}

// recordingPortals passes specs to the iptables portals on a fake runner and keeps the last ones.
type recordingPortals struct {
	next    portal.Portals
	mu      sync.Mutex
	specs   []portal.Spec
	syncs   int
	changed chan struct{}
}

func (r *recordingPortals) Sync(ctx context.Context, specs []portal.Spec) error {
	err := r.next.Sync(ctx, specs)
	r.mu.Lock()
	r.specs = slices.Clone(specs)
	r.syncs++
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
	return err
}

func (r *recordingPortals) Cleanup(ctx context.Context) error { return r.next.Cleanup(ctx) }

// waitProxyPort waits until the portals were given a spec for name with a proxy port.
func (r *recordingPortals) waitProxyPort(t *testing.T, name service.ServicePortName) uint16 {
	t.Helper()
	return r.waitSpec(t, name.String(), func(s portal.Spec) bool { return s.Name == name }).ProxyPort
}

// waitSpec waits until the portals were given a spec with a proxy port that match accepts.
func (r *recordingPortals) waitSpec(t *testing.T, what string, match func(portal.Spec) bool) portal.Spec {
	t.Helper()
	deadline := time.After(waitFor)
	for {
		r.mu.Lock()
		i := slices.IndexFunc(r.specs, func(s portal.Spec) bool { return s.ProxyPort != 0 && match(s) })
		var spec portal.Spec
		if i >= 0 {
			spec = r.specs[i]
		}
		r.mu.Unlock()
		if i >= 0 {
			return spec
		}
		select {
		case <-r.changed:
		case <-deadline:
			t.Fatalf("portals never got a spec for %s with a proxy port; last specs %+v", what, r.specs)
		}
	}
}

// harness is a daemon built from a command line with fakes for everything root-only.
type harness struct {
	d        *Daemon
	host     *fakeHost
	portals  *recordingPortals
	iptables *iptables.Fake
	clk      *clocktesting.FakeClock
	hup      chan chan<- os.Signal // the daemon's reload channel, once it listens for SIGHUP
	log      *logtest.Hook

	mu    sync.Mutex
	addrs map[string]string // requested HTTP address -> bound address
}

func newHarness(t *testing.T, args ...string) *harness {
	t.Helper()
	o, _, err := parseOptions(args)
	if err != nil {
		t.Fatalf("parseOptions(%q): %v", args, err)
	}
	o.bind = netip.MustParseAddr("127.0.0.1")
	log, hook := logtest.NewNullLogger()
	log.SetLevel(logrus.DebugLevel)
	h := &harness{host: &fakeHost{}, iptables: iptables.NewFake(), clk: clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0)),
		log: hook, hup: make(chan chan<- os.Signal, 1), addrs: map[string]string{}}
	rules := iptables.New(iptables.Config{BindAddress: o.bind, Logger: log}, h.iptables)
	h.portals = &recordingPortals{next: rules, changed: make(chan struct{}, 1)}
	h.d = &Daemon{o: o, version: "test", log: log, deps: deps{
		host: h.host,
		client: func(*Options, string) (kubernetes.Interface, error) {
			return nil, errors.New("the file mode must not build an API client")
		},
		portals: func(context.Context, *Options, map[portal.Family]netip.Addr, *serviceEvents, *handover.Inherited, logrus.FieldLogger) (portalMode, error) {
			return &testMode{portals: h.portals, rules: rules}, nil
		},
		listen: func(addr string) (net.Listener, error) {
			ln, err := net.Listen("tcp", addr)
			if err == nil {
				h.mu.Lock()
				h.addrs[addr] = ln.Addr().String()
				h.mu.Unlock()
			}
			return ln, err
		},
		notifyReload: func(c chan<- os.Signal) func() { h.hup <- c; return func() {} },
		clock:        h.clk,
	}}
	return h
}

// testMode is the harness's portal mode: the recording portals in front of rules on a fake
// iptables, with their metrics and /debug/rules; no NAT probe, conntrack or kernel counters.
type testMode struct {
	portals portal.Portals
	rules   *iptables.Portals
}

func (m *testMode) Portals() portal.Portals         { return m.portals }
func (m *testMode) Describe() string                { return m.rules.Rules() }
func (m *testMode) Close() error                    { return nil }
func (m *testMode) Collector() prometheus.Collector { return portalCollector(m.rules) }

// testModeHostIPs is testMode taking the node IPs (hostIPSetter) as set says.
type testModeHostIPs struct {
	*testMode
	set func(map[portal.Family]netip.Addr)
}

func (m *testModeHostIPs) SetHostIPs(ips map[portal.Family]netip.Addr) { m.set(ips) }

// start runs the daemon; the returned function cancels it and returns Run's error.
func (h *harness) start(t *testing.T) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- h.d.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-errc:
			case <-time.After(waitFor):
				err = errors.New("Run did not return after its context was cancelled")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func (h *harness) url(t *testing.T, requested, path string) string {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	a, ok := h.addrs[requested]
	if !ok {
		t.Fatalf("no HTTP server listens for %s (have %v)", requested, h.addrs)
	}
	return "http://" + a + path
}

// echoServer echoes every TCP connection on 127.0.0.1 until the test ends.
var echoServer = testenv.EchoTCP

// writeService writes a Service with one TCP port and an EndpointSlice with one ready endpoint.
func writeService(t *testing.T, dir, name, clusterIP string, ep netip.AddrPort) {
	t.Helper()
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Service
metadata:
  name: %[1]s
  namespace: default
spec:
  clusterIP: %[2]s
  ports:
  - name: tcp
    port: 80
    targetPort: %[4]d
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: %[1]s-1
  namespace: default
  labels:
    kubernetes.io/service-name: %[1]s
addressType: IPv4
endpoints:
- addresses: ["%[3]s"]
  conditions: {ready: true}
ports:
- name: tcp
  port: %[4]d
  protocol: TCP
`, name, clusterIP, ep.Addr(), ep.Port())
	if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
}

// echo sends a line through addr and returns what comes back.
func echo(t *testing.T, addr string) string {
	t.Helper()
	got, err := tryEcho(addr)
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func tryEcho(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, waitFor)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(waitFor))
	if _, err := io.WriteString(c, "hello through the proxy\n"); err != nil {
		return "", err
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

var get = testenv.Get

// waitGoroutines waits until no more goroutines run than before: everything the daemon started
// has stopped.
func waitGoroutines(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines still run, %d before the daemon started:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
}

func errorLines(hook *logtest.Hook) []string {
	var out []string
	for _, e := range hook.AllEntries() {
		if e.Level <= logrus.ErrorLevel {
			out = append(out, fmt.Sprintf("%s %v", e.Message, e.Data))
		}
	}
	return out
}

// TestDaemonServesAServicesFile runs the daemon, as wired for production, from a services file:
// the service answers through its proxy socket, the HTTP servers answer, SIGHUP reloads, and
// cancelling the context stops everything it started.
func TestDaemonServesAServicesFile(t *testing.T) {
	backend := echoServer(t)
	dir := t.TempDir()
	writeService(t, dir, "echo", "10.96.0.10", backend)
	before := runtime.NumGoroutine()

	// No minimum sync period: on the fake clock a change then syncs at once.
	h := newHarness(t, "--services-file="+dir, "--iptables-min-sync-period=0",
		"--healthz-bind-address=127.0.0.1:0", "--metrics-bind-address=127.0.0.2:0")
	stop := h.start(t)
	echoName := service.ServicePortName{Namespace: "default", Name: "echo", Port: "tcp"}
	proxyPort := h.portals.waitProxyPort(t, echoName)

	t.Run("service_answers_through_its_proxy_socket", func(t *testing.T) {
		addr := fmt.Sprintf("127.0.0.1:%d", proxyPort)
		if got, want := echo(t, addr), "hello through the proxy\n"; got != want {
			t.Errorf("echo through %s = %q, want %q", addr, got, want)
		}
	})
	t.Run("healthz_and_livez", func(t *testing.T) {
		for _, path := range []string{"/healthz", "/livez"} {
			if code, body := get(t, h.url(t, "127.0.0.1:0", path)); code != http.StatusOK {
				t.Errorf("GET %s = %d %q, want 200 after a sync", path, code, body)
			}
		}
	})
	t.Run("metrics_and_debug_pages", func(t *testing.T) {
		_, metrics := get(t, h.url(t, "127.0.0.2:0", "/metrics"))
		for _, want := range []string{
			"kubeproxy_sync_proxy_rules_last_timestamp_seconds ",
			`kube_portal_proxy_tcp_connections_total{service_port="default/echo:tcp"} 1`,
			"kube_portal_proxy_portal_rules ",
			"go_goroutines ",
		} {
			if !strings.Contains(metrics, want) {
				t.Errorf("/metrics lacks %q", want)
			}
		}
		if _, got := get(t, h.url(t, "127.0.0.2:0", "/proxyMode")); got != "userspace" {
			t.Errorf("/proxyMode = %q", got)
		}
		if _, rules := get(t, h.url(t, "127.0.0.2:0", "/debug/rules")); !strings.Contains(rules, `"default/echo:tcp"`) ||
			!strings.Contains(rules, fmt.Sprintf("--to-destination 127.0.0.1:%d", proxyPort)) {
			t.Errorf("/debug/rules does not show the portal of default/echo:tcp to port %d:\n%s", proxyPort, rules)
		}
	})
	t.Run("sighup_reloads_the_services_file", func(t *testing.T) {
		writeService(t, dir, "second", "10.96.0.11", backend)
		select {
		case c := <-h.hup:
			c <- os.Interrupt // any signal value: the channel is SIGHUP's
		case <-time.After(waitFor):
			t.Fatal("the daemon never listened for SIGHUP")
		}
		second := service.ServicePortName{Namespace: "default", Name: "second", Port: "tcp"}
		port := h.portals.waitProxyPort(t, second)
		// The socket may open between the Service and its EndpointSlice: until the endpoint
		// arrives, connections are reset (no endpoints). Wait for it.
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		deadline := time.Now().Add(waitFor)
		for {
			got, err := tryEcho(addr)
			if err == nil && got == "hello through the proxy\n" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("echo through the reloaded service = %q, %v", got, err)
			}
			time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
		}
	})

	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	waitGoroutines(t, before)
	if _, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", proxyPort), time.Second); err == nil {
		t.Error("the proxy socket still accepts after Run returned")
	}
	if h.host.tuned != 1 || h.host.checks != 1 || h.host.settled != 1 {
		t.Errorf("host tuned %d times, checked %d times, settled after the first sync %d times; want once each",
			h.host.tuned, h.host.checks, h.host.settled)
	}
	if lines := errorLines(h.log); len(lines) > 0 {
		t.Errorf("errors logged: %q", lines)
	}
}

// TestDaemonStartFailuresLeaveNothingRunning checks that a daemon that cannot start says why and
// stops what it had started.
func TestDaemonStartFailuresLeaveNothingRunning(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	tests := []struct {
		name    string
		args    []string
		setup   func(h *harness)
		wantErr string
	}{{
		name:    "metrics_address_in_use",
		args:    []string{"--healthz-bind-address=127.0.0.1:0", "--metrics-bind-address=" + taken.Addr().String()},
		wantErr: "listen " + taken.Addr().String(),
	}, {
		name:    "host_check_fails",
		args:    []string{"--healthz-bind-address=127.0.0.1:0"},
		setup:   func(h *harness) { h.host.checkErr = errors.New("iptables-restore not found in PATH") },
		wantErr: "iptables-restore not found",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := runtime.NumGoroutine()
			h := newHarness(t, append([]string{"--services-file=" + t.TempDir()}, tt.args...)...)
			if tt.setup != nil {
				tt.setup(h)
			}
			err := h.d.Run(context.Background())
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Run = %v, want an error containing %q", err, tt.wantErr)
			}
			waitGoroutines(t, before)
			h.mu.Lock()
			defer h.mu.Unlock()
			for _, a := range h.addrs {
				if c, err := net.DialTimeout("tcp", a, time.Second); err == nil {
					c.Close()
					t.Errorf("%s still accepts after a failed start", a)
				}
			}
		})
	}
}

// TestRunAllBoundsTheShutdown checks --shutdown-timeout: a task that does not stop makes Run fail
// once the timeout has passed on the clock.
func TestRunAllBoundsTheShutdown(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	ctx, cancel := context.WithCancel(context.Background())
	release := make(chan struct{})
	defer close(release)
	errc := make(chan error, 1)
	log, _ := logtest.NewNullLogger()
	go func() {
		errc <- runAll(ctx, clk, 10*time.Second, log, func(context.Context) { <-release }, func(ctx context.Context) { <-ctx.Done() })
	}()
	cancel()
	testenv.WaitFor(t, "runAll to wait on the clock", clk.HasWaiters)
	clk.Step(10 * time.Second)
	select {
	case err := <-errc:
		if err == nil || !strings.Contains(err.Error(), "--shutdown-timeout=10s") {
			t.Errorf("runAll = %v, want the shutdown timeout named", err)
		}
	case <-time.After(waitFor):
		t.Fatal("runAll did not return after the shutdown timeout")
	}
}

// TestDaemonLogsAFailingSyncOnce checks that an iptables-restore failure is logged with what
// failed when it starts and when it ends, not on every retry.
func TestDaemonLogsAFailingSyncOnce(t *testing.T) {
	dir := t.TempDir()
	writeService(t, dir, "echo", "10.96.0.10", echoServer(t))
	h := newHarness(t, "--services-file="+dir, "--healthz-bind-address=", "--metrics-bind-address=")
	var broken atomic.Bool
	broken.Store(true)
	h.iptables.RestoreHook = func(_ portal.Family, data []byte) error {
		if broken.Load() && bytes.HasPrefix(data, []byte("*filter")) {
			return &iptables.ExitError{Command: "iptables-restore", Code: 4, Stderr: "Another app is currently holding the xtables lock."}
		}
		return nil
	}
	h.start(t)
	for attempt := 1; attempt <= 3; attempt++ {
		t.Logf("attempt %d", attempt)
		h.portals.waitSync(t)
		if attempt == 3 {
			broken.Store(false)
		}
		h.clk.Step(time.Second) // the retry interval: the run started before the step, so it is due
	}
	h.portals.waitProxyPort(t, service.ServicePortName{Namespace: "default", Name: "echo", Port: "tcp"})
	deadline := time.Now().Add(waitFor)
	var got []string
	for {
		got = got[:0]
		for _, e := range h.log.AllEntries() {
			if strings.HasPrefix(e.Message, "Sync ") && e.Level <= logrus.InfoLevel {
				got = append(got, fmt.Sprintf("%s: %s %v", e.Level, e.Message, e.Data["error"]))
			}
		}
		if len(got) >= 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
	want := []string{
		"error: Sync failed sync portals of 1 service ports (changed since the last good sync: default/echo:tcp): " +
			"portal IPv4 filter: restore: iptables-restore: exit status 4: Another app is currently holding the xtables lock.",
		"info: Sync recovered <nil>",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("sync log lines (-want +got):\n%s", diff)
	}
}

// waitSync waits for the next portal sync.
func (r *recordingPortals) waitSync(t *testing.T) {
	t.Helper()
	select {
	case <-r.changed:
	case <-time.After(waitFor):
		r.mu.Lock()
		defer r.mu.Unlock()
		t.Fatalf("no portal sync within %v (%d syncs before)", waitFor, r.syncs)
	}
}

// TestDaemonServesFromTheAPIServer runs the cluster mode against a fake API server: the Node's
// addresses are read, Services and EndpointSlices come from informers, and a service port that
// finds the proxy port range exhausted gets a Warning event on its Service.
func TestDaemonServesFromTheAPIServer(t *testing.T) {
	backend := echoServer(t)
	// One proxy port for two services: the second finds the range exhausted.
	hold, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	onlyPort := netip.MustParseAddrPort(hold.Addr().String()).Port()
	hold.Close()

	objects := []k8sruntime.Object{
		&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Status: v1.NodeStatus{Addresses: []v1.NodeAddress{
			{Type: v1.NodeInternalIP, Address: "192.0.2.10"}}}},
	}
	for _, name := range []string{"echo", "second"} {
		objects = append(objects,
			&v1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, UID: types.UID("uid-" + name)}, Spec: v1.ServiceSpec{
				ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"}, Type: v1.ServiceTypeClusterIP,
				Ports: []v1.ServicePort{{Name: "tcp", Port: 80, Protocol: v1.ProtocolTCP}}}},
			&discovery.EndpointSlice{
				ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name + "-1",
					Labels: map[string]string{discovery.LabelServiceName: name}},
				AddressType: discovery.AddressTypeIPv4,
				Endpoints: []discovery.Endpoint{{Addresses: []string{backend.Addr().String()},
					Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}}},
				Ports: []discovery.EndpointPort{{Name: ptr.To("tcp"), Port: ptr.To(int32(backend.Port())), Protocol: ptr.To(v1.ProtocolTCP)}},
			})
	}
	client := fake.NewClientset(objects...)
	before := runtime.NumGoroutine()

	h := newHarness(t, "--hostname-override=node-1", fmt.Sprintf("--proxy-port-range=%d", onlyPort),
		"--healthz-bind-address=", "--metrics-bind-address=")
	// The portals start with the interfaces' addresses (the restart serves before it reads the
	// Node); the Node's InternalIP must be set before the first sync programs anything.
	var (
		mu          sync.Mutex
		gotHostIPs  map[portal.Family]netip.Addr
		syncsBefore = -1
	)
	portals := h.d.deps.portals
	h.d.deps.portals = func(ctx context.Context, o *Options, hostIPs map[portal.Family]netip.Addr, ev *serviceEvents, inh *handover.Inherited, log logrus.FieldLogger) (portalMode, error) {
		pm, err := portals(ctx, o, hostIPs, ev, inh, log)
		if pm != nil {
			pm = &testModeHostIPs{testMode: pm.(*testMode), set: func(ips map[portal.Family]netip.Addr) {
				h.portals.mu.Lock()
				n := h.portals.syncs
				h.portals.mu.Unlock()
				mu.Lock()
				gotHostIPs, syncsBefore = ips, n
				mu.Unlock()
			}}
		}
		return pm, err
	}
	h.d.deps.client = func(*Options, string) (kubernetes.Interface, error) { return client, nil }
	stop := h.start(t)
	t.Cleanup(func() {
		if t.Failed() {
			for _, e := range h.log.AllEntries() {
				t.Logf("log: %s %v", e.Message, e.Data)
			}
		}
	})

	// Which service wins the one port depends on the order of the sync.
	spec := h.portals.waitSpec(t, "either service", func(portal.Spec) bool { return true })
	if spec.ProxyPort != onlyPort {
		t.Errorf("%s got proxy port %d, want the range's only port %d", spec.Name, spec.ProxyPort, onlyPort)
	}
	if got := echo(t, fmt.Sprintf("127.0.0.1:%d", spec.ProxyPort)); got != "hello through the proxy\n" {
		t.Errorf("echo through the proxy port = %q", got)
	}
	deadline := time.Now().Add(waitFor)
	for {
		evs, err := client.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if i := slices.IndexFunc(evs.Items, func(e v1.Event) bool { return e.Reason == "ProxyPortRangeExhausted" }); i >= 0 {
			e := evs.Items[i]
			if e.Type != v1.EventTypeWarning || e.InvolvedObject.Kind != "Service" || e.Source.Host != "node-1" ||
				e.InvolvedObject.UID != types.UID("uid-"+e.InvolvedObject.Name) {
				t.Errorf("event %+v: want a Warning on the Service from node-1", e)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ProxyPortRangeExhausted event; events: %+v", evs.Items)
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	waitGoroutines(t, before)
	mu.Lock()
	defer mu.Unlock()
	if want := netip.MustParseAddr("192.0.2.10"); gotHostIPs[portal.IPv4] != want {
		t.Errorf("host IPs %v, want the Node's InternalIP %v first", gotHostIPs, want)
	}
	if syncsBefore != 0 {
		t.Errorf("the Node's addresses reached the portals after %d portal syncs, want before the first", syncsBefore)
	}
}
