package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

// Address plan: internal/testbed's. A real nginx in pod1 (10.244.1.10) serves static files on
// 8088 (a port tshark decodes as HTTP, like the service's 80); the client pod (172.30.0.2)
// reaches the Service at its cluster IP. The proxy and `observe` run in the node namespace;
// observe reaches the proxy's flow stream on the node's loopback metrics address.

// ocNginxPort is where nginx listens in pod1.
const ocNginxPort = 8088

// ocCaptureCap is the proxy's default per-flow capture cap (--flow-capture-bytes), both
// directions together.
const ocCaptureCap = 64 << 10

// ocFiles are what nginx serves: two files whose exchange fits under the cap and one far above
// it. Binary content: tshark's follow must give back every byte value.
func ocFiles() map[string][]byte {
	r := rand.New(rand.NewChaCha8([32]byte{'k', 'p', 'p'}))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		return b
	}
	return map[string][]byte{
		"small.bin": random(20000),
		"hello.txt": []byte("hello from nginx behind kube-portal-proxy\n"),
		"big.bin":   random(200000),
	}
}

// ocStartNginx runs a real nginx in ns, one process in the foreground with its files in a
// temporary directory, serving files from its root on listen (keep-alive on). The test's cleanup
// stops it. It returns when nginx answers a dial from dialFrom.
func ocStartNginx(t *testing.T, ns *netns.NS, dialFrom *netns.NS, listen netip.AddrPort, files map[string][]byte) {
	t.Helper()
	bin := testenv.FindNginx(t)
	dir := t.TempDir()
	root := filepath.Join(dir, "www")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(root, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	conf := fmt.Sprintf(`daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log info;
events { worker_connections 64; }
http {
    access_log off;
    keepalive_timeout 60s;
    client_body_temp_path %[1]s/body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    server {
        listen %[2]s;
        root %[3]s;
        default_type application/octet-stream;
    }
}
`, dir, listen, root)
	path := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns.Name, bin, "-p", dir, "-c", path, "-e", filepath.Join(dir, "error.log"))
	out := &testenv.SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start nginx in %s: %v", ns.Name, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cancel() // SIGKILL: nothing of nginx's state matters after the test
		<-exited
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.Logf("nginx output:\n%s\nerror log:\n%s", out.String(), log)
		}
	})
	eventually(t, 10*time.Second, "nginx to listen on "+listen.String(), func() error {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("nginx exited: %v\n%s", err, out.String())
		default:
		}
		c, err := testbed.Dial(dialFrom, listen, time.Second)
		if err != nil {
			return err
		}
		return c.Close()
	})
}

// ocExchange is one TCP connection's HTTP conversation as the client saw it.
type ocExchange struct {
	local                        netip.AddrPort // the client's address
	sent, received               []byte         // every byte written and read
	bodies                       [][]byte       // the responses' bodies, in order
	wantToEndpoint, wantToClient []byte         // what the capture must hold (set by the caller)
}

// ocGet sends the GETs for paths one after another on one connection from ns to addr, each after
// the previous response was read whole; the last asks nginx to close. It returns every byte sent
// and received.
func ocGet(ns *netns.NS, addr netip.AddrPort, paths ...string) (*ocExchange, error) {
	c, err := testbed.Dial(ns, addr, requestTimeout)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	ex := &ocExchange{local: netip.MustParseAddrPort(c.LocalAddr().String())}
	var in bytes.Buffer
	r := bufio.NewReader(io.TeeReader(c, &in))
	for i, p := range paths {
		conn := "keep-alive"
		if i == len(paths)-1 {
			conn = "close"
		}
		req := fmt.Sprintf("GET /%s HTTP/1.1\r\nHost: web\r\nUser-Agent: kpp-e2e\r\nConnection: %s\r\n\r\n", p, conn)
		if _, err := io.WriteString(c, req); err != nil {
			return nil, fmt.Errorf("send GET /%s: %w", p, err)
		}
		ex.sent = append(ex.sent, req...)
		resp, err := http.ReadResponse(r, nil)
		if err != nil {
			return nil, fmt.Errorf("GET /%s: read response: %w", p, err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("GET /%s: %d, %d bytes, %v", p, resp.StatusCode, len(body), err)
		}
		ex.bodies = append(ex.bodies, body)
	}
	// nginx closes after the last response: read to its FIN, so every byte it sent is counted.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return nil, fmt.Errorf("read to the end: %w", err)
	}
	ex.received = in.Bytes()
	return ex, nil
}

// ocEnds asks the proxy's flow stream on the node (not followed: the ring) for the End events of
// the service's flows, by client address.
func ocEnds(node *netns.NS, service string) (map[string]*observe.Flow, error) {
	q := url.Values{"service": {service}, "phase": {"end"}}
	code, body, err := httpGet(node, "http://"+metricsAddr+"/debug/flows?"+q.Encode())
	if err != nil || code != http.StatusOK {
		return nil, fmt.Errorf("GET /debug/flows: %d %q, %v", code, body, err)
	}
	ends := map[string]*observe.Flow{}
	for line := range strings.Lines(body) {
		var it observe.Item
		if err := json.Unmarshal([]byte(line), &it); err != nil {
			return nil, fmt.Errorf("/debug/flows line %q: %w", line, err)
		}
		if it.Flow != nil {
			ends[it.Flow.Client] = it.Flow
		}
	}
	return ends, nil
}

// ocObserver is `kube-portal-proxy observe` running in the node namespace.
type ocObserver struct {
	cmd            *exec.Cmd
	stdout, stderr *testenv.SyncBuffer
	exited         chan error
	err            error // the exit, once received from exited
	done           bool
}

// ocStartObserve runs the observe command with args in ns. The test's cleanup kills it if it
// still runs.
func ocStartObserve(t *testing.T, ns *netns.NS, args ...string) *ocObserver {
	t.Helper()
	o := &ocObserver{stdout: &testenv.SyncBuffer{}, stderr: &testenv.SyncBuffer{}, exited: make(chan error, 1)}
	o.cmd = exec.Command("ip", append([]string{"netns", "exec", ns.Name, proxyBinary, "observe"}, args...)...)
	o.cmd.Stdout, o.cmd.Stderr = o.stdout, o.stderr
	if err := o.cmd.Start(); err != nil {
		t.Fatalf("start observe: %v", err)
	}
	go func() { o.exited <- o.cmd.Wait() }()
	t.Cleanup(func() {
		if !o.done {
			_ = o.cmd.Process.Kill()
			<-o.exited
		}
		if t.Failed() {
			t.Logf("observe %s\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), o.stdout.String(), o.stderr.String())
		}
	})
	return o
}

// running returns an error if the observer has exited.
func (o *ocObserver) running() error {
	if o.done {
		return fmt.Errorf("observe exited: %v; stderr: %s", o.err, o.stderr.String())
	}
	select {
	case o.err = <-o.exited:
		o.done = true
		return fmt.Errorf("observe exited: %v; stderr: %s", o.err, o.stderr.String())
	default:
		return nil
	}
}

// wait waits (bounded) for the observer's exit and returns its exit code.
func (o *ocObserver) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	if !o.done {
		select {
		case o.err = <-o.exited:
			o.done = true
		case <-time.After(timeout):
			t.Fatalf("observe still runs %v after it was asked to stop", timeout)
		}
	}
	var exit *exec.ExitError
	switch {
	case o.err == nil:
		return 0
	case errors.As(o.err, &exit):
		return exit.ExitCode()
	}
	t.Fatalf("observe: %v", o.err)
	return -1
}

// ocTshark runs tshark on file with args and returns its standard output; an error, or anything
// on its standard error but the warning about running as root, fails the test.
func ocTshark(t *testing.T, file string, args ...string) string {
	t.Helper()
	bin, err := exec.LookPath("tshark")
	if err != nil {
		testenv.Unavailable(t, "tshark not installed (hack/install-deps.sh test, or apt-get install tshark)")
	}
	cmd := exec.Command(bin, append([]string{"-n", "-r", file,
		"-o", "ip.check_checksum:TRUE", "-o", "tcp.check_checksum:TRUE"}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("tshark %v: %v\n%s", args, err, stderr.String())
	}
	for l := range strings.Lines(stderr.String()) {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "Running as user ") {
			t.Fatalf("tshark %v wrote to stderr:\n%s", args, stderr.String())
		}
	}
	return stdout.String()
}

// ocFields runs tshark -T fields with filter, one []string per packet.
func ocFields(t *testing.T, file, filter string, names ...string) [][]string {
	t.Helper()
	args := []string{"-Y", filter, "-T", "fields", "-E", "separator=|"}
	for _, n := range names {
		args = append(args, "-e", n)
	}
	var out [][]string
	for line := range strings.Lines(ocTshark(t, file, args...)) {
		if line = strings.TrimRight(line, "\n"); line != "" {
			out = append(out, strings.Split(line, "|"))
		}
	}
	return out
}

// ocFollow returns what each side sent on TCP stream n, as `tshark -z follow,tcp,raw,n`
// reassembles it: node 0 (the side of the first packet, the connecting one) and node 1.
func ocFollow(t *testing.T, file string, n int) (fromConnector, fromAcceptor []byte) {
	t.Helper()
	out := ocTshark(t, file, "-q", "-z", fmt.Sprintf("follow,tcp,raw,%d", n))
	inData := false
	for line := range strings.Lines(out) {
		line = strings.TrimRight(line, "\n")
		switch {
		case strings.HasPrefix(line, "Node 1:"):
			inData = true
			continue
		case strings.HasPrefix(line, "====="):
			inData = false
			continue
		case !inData || line == "":
			continue
		}
		dst := &fromConnector
		if strings.HasPrefix(line, "\t") { // tshark indents what node 1 sent
			dst = &fromAcceptor
		}
		b, err := hex.DecodeString(strings.TrimSpace(line))
		if err != nil {
			t.Fatalf("follow stream %d: line %q: %v", n, line, err)
		}
		*dst = append(*dst, b...)
	}
	return fromConnector, fromAcceptor
}

func ocFirstDiff(a, b []byte) string {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return fmt.Sprintf("first difference at byte %d", i)
		}
	}
	return fmt.Sprintf("one is a prefix of the other (%d, %d bytes)", len(a), len(b))
}

// ocSummary matches observe --pcap's last line on stderr (main.go's capture.Close).
var ocSummary = regexp.MustCompile(`capture: (\d+) packets of (\d+) flows, \d+ bytes(.*)`)

// TestObserveCaptureHTTP: `kube-portal-proxy observe --service NS/NAME --follow --pcap FILE`
// against a proxy run with --flow-capture, on each I/O engine, while a client pod fetches files
// from a real nginx behind the Service: one keep-alive connection whose two exchanges fit under
// the per-flow capture cap, and one connection fetching a file far above it. Stopped with SIGINT
// once its table showed both flows' ends, observe exits 0 and says what it captured; tshark reads
// the file with no malformed packet, bad checksum or expert warning, finds the request URIs on
// both legs, and "follow TCP stream" on the client's leg and on the pod's leg gives back exactly
// the bytes the client sent and received, or, for the big file, exactly the first 64 KiB of the
// conversation. A proxy without --flow-capture refuses the capture: observe --pcap exits 1
// saying the proxy answered 403 and why.
func TestObserveCaptureHTTP(t *testing.T) {
	n := newClusterNode(t, 1)
	pod := n.bed.Pods[0]
	files := ocFiles()
	ocStartNginx(t, pod.NS, n.bed.Node, netip.AddrPortFrom(pod.IP, ocNginxPort), files)
	svc := n.createService(t, "web", corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, Ports: []corev1.ServicePort{
		{Name: "http", Protocol: corev1.ProtocolTCP, Port: 80, TargetPort: intstr.FromInt32(ocNginxPort)}}})
	n.setEndpoints(t, svc, 1)
	addr := targetsOf(t, svc).clusterTCP
	name := svc.Namespace + "/" + svc.Name

	// One proxy at a time on the node (they share its addresses), hence no t.Parallel.
	for _, engine := range []string{tcp.EngineIOUring, tcp.EngineEpoll} {
		t.Run(engine, func(t *testing.T) {
			if engine == tcp.EngineIOUring {
				if err := tcp.ProbeIOUring(); err != nil {
					testenv.Unavailable(t, "io_uring unavailable: %v", err)
				}
			}
			proxy := n.startProxy(t, "--io-engine="+engine, "--flow-capture")
			// Served, and the readiness request's flow ended before observe starts: the capture
			// holds the test's flows only.
			var ready *ocExchange
			eventually(t, 30*time.Second, "the service to answer through the proxy", func() error {
				if err := proxy.exited(); err != nil {
					return err
				}
				var err error
				ready, err = ocGet(n.bed.Client, addr, "hello.txt")
				return err
			})
			eventually(t, 10*time.Second, "the readiness request's End in /debug/flows", func() error {
				ends, err := ocEnds(n.bed.Node, name)
				if err != nil {
					return err
				}
				if ends[ready.local.String()] == nil {
					return fmt.Errorf("no End of %s in %d ends", ready.local, len(ends))
				}
				return nil
			})
			series := fmt.Sprintf("kube_portal_proxy_io_engine{engine=%q}", engine)
			if v, err := scrape(n.bed.Node, series); err != nil || v != 1 {
				t.Fatalf("%s = %v, %v; want 1: the proxy does not serve on the engine under test", series, v, err)
			}
			testCaptureHTTP(t, n, name, addr, files)
		})
	}

	t.Run("refused_without_flow_capture", func(t *testing.T) {
		proxy := n.startProxy(t)
		eventually(t, 30*time.Second, "the proxy's metrics address to answer", func() error {
			if err := proxy.exited(); err != nil {
				return err
			}
			_, err := scrape(n.bed.Node, `kube_portal_proxy_flow_observers{kind="all"}`)
			return err
		})
		file := filepath.Join(t.TempDir(), "refused.pcapng")
		o := ocStartObserve(t, n.bed.Node, "--service", name, "--follow", "--pcap", file)
		if code := o.wait(t, 30*time.Second); code != 1 {
			t.Errorf("observe --pcap against a proxy without --flow-capture exited %d, want 1", code)
		}
		msg := o.stderr.String()
		for _, want := range []string{"403", "payload capture is disabled on this proxy"} {
			if !strings.Contains(msg, want) {
				t.Errorf("observe's error %q does not say %q", msg, want)
			}
		}
	})
}

// testCaptureHTTP runs the capture and checks it, with the proxy under test running on the node.
func testCaptureHTTP(t *testing.T, n *clusterNode, service string, addr netip.AddrPort, files map[string][]byte) {
	file := filepath.Join(t.TempDir(), "flows.pcapng")
	o := ocStartObserve(t, n.bed.Node, "--service", service, "--follow", "--pcap", file)
	eventually(t, 10*time.Second, "observe to subscribe with capture", func() error {
		if err := o.running(); err != nil {
			return err
		}
		const series = `kube_portal_proxy_flow_observers{kind="capture"}`
		if v, err := scrape(n.bed.Node, series); err != nil || v != 1 {
			return fmt.Errorf("%s = %v, %v; want 1", series, v, err)
		}
		return nil
	})

	keep, err := ocGet(n.bed.Client, addr, "small.bin", "hello.txt")
	if err != nil {
		t.Fatalf("keep-alive exchange: %v", err)
	}
	big, err := ocGet(n.bed.Client, addr, "big.bin")
	if err != nil {
		t.Fatalf("big exchange: %v", err)
	}
	for i, c := range []struct {
		ex    *ocExchange
		files []string
	}{{keep, []string{"small.bin", "hello.txt"}}, {big, []string{"big.bin"}}} {
		for j, f := range c.files {
			if !bytes.Equal(c.ex.bodies[j], files[f]) {
				t.Fatalf("exchange %d: body of /%s: %d bytes, not the file's %d", i, f, len(c.ex.bodies[j]), len(files[f]))
			}
		}
	}
	if total := len(keep.sent) + len(keep.received); total >= ocCaptureCap {
		t.Fatalf("the keep-alive exchange moved %d bytes: it must fit under the capture cap %d", total, ocCaptureCap)
	}
	// The cap counts both directions in the order the bytes moved: the request first, then the
	// response up to the cap.
	keep.wantToEndpoint, keep.wantToClient = keep.sent, keep.received
	big.wantToEndpoint, big.wantToClient = big.sent, big.received[:ocCaptureCap-len(big.sent)]

	// observe's table shows a row per flow when it ends: once both clients' rows are there, it has
	// had every event and payload of both flows.
	eventually(t, 15*time.Second, "observe's table to show both flows' ends", func() error {
		out := o.stdout.String()
		for _, ex := range []*ocExchange{keep, big} {
			if !strings.Contains(out, ex.local.String()+" ") {
				if err := o.running(); err != nil {
					return err
				}
				return fmt.Errorf("no row for client %s yet", ex.local)
			}
		}
		return nil
	})
	if err := o.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatalf("SIGINT observe: %v", err)
	}
	if code := o.wait(t, 20*time.Second); code != 0 {
		t.Fatalf("observe exited %d after SIGINT, want 0; stderr: %s", code, o.stderr.String())
	}
	m := ocSummary.FindStringSubmatch(o.stderr.String())
	if m == nil {
		t.Fatalf("observe's stderr has no capture summary: %q", o.stderr.String())
	}
	if m[2] != "2" || strings.TrimSpace(m[3]) != "; 1 flows cut at their capture cap" {
		t.Errorf("capture summary %q: want 2 flows, 1 cut at its cap, nothing else left out", m[0])
	}

	// The flows as the proxy recorded them: the pod leg's source address, and byte counts.
	ends, err := ocEnds(n.bed.Node, service)
	if err != nil {
		t.Fatal(err)
	}
	ocCheckFile(t, file, ends, keep, big)
}

// ocCheckFile checks the capture file written while keep and big were served.
func ocCheckFile(t *testing.T, file string, ends map[string]*observe.Flow, keep, big *ocExchange) {
	t.Helper()
	bad := ocFields(t, file, "_ws.malformed || _ws.expert.severity >= warning", "frame.number", "_ws.expert.message")
	if len(bad) > 0 {
		t.Errorf("tshark finds problems (frame|message): %q", bad)
	}
	for _, p := range ocFields(t, file, "ip", "frame.number", "ip.checksum.status", "tcp.checksum.status") {
		for _, s := range p[1:] {
			if s != "" && s != "1" { // 1: good
				t.Errorf("frame %s: checksum status %q, want 1 (good)", p[0], s)
			}
		}
	}
	// Each leg's stream, by the address of the side that opened it.
	streams := map[string]int{}
	for _, p := range ocFields(t, file, "tcp.flags.syn == 1 && tcp.flags.ack == 0", "tcp.stream", "ip.src", "tcp.srcport") {
		s, err := strconv.Atoi(p[0])
		if err != nil {
			t.Fatalf("tcp.stream %q: %v", p[0], err)
		}
		streams[net.JoinHostPort(p[1], p[2])] = s
	}
	if len(streams) != 4 {
		t.Errorf("SYNs of %d streams (%v), want 4: two flows, two legs each", len(streams), streams)
	}
	uris := map[int][]string{}
	for _, p := range ocFields(t, file, "http.request", "tcp.stream", "http.request.uri") {
		s, _ := strconv.Atoi(p[0])
		uris[s] = append(uris[s], p[1])
	}
	for _, c := range []struct {
		name string
		ex   *ocExchange
		uris []string
	}{{"keep-alive", keep, []string{"/small.bin", "/hello.txt"}}, {"big", big, []string{"/big.bin"}}} {
		end := ends[c.ex.local.String()]
		if end == nil {
			t.Errorf("%s: no End event for client %s in /debug/flows", c.name, c.ex.local)
			continue
		}
		if end.BytesToEndpoint != uint64(len(c.ex.sent)) || end.BytesToClient != uint64(len(c.ex.received)) {
			t.Errorf("%s: End event counts %d bytes to the endpoint, %d to the client; the client sent %d, received %d",
				c.name, end.BytesToEndpoint, end.BytesToClient, len(c.ex.sent), len(c.ex.received))
		}
		for _, leg := range []struct{ name, from string }{{"client leg", c.ex.local.String()}, {"pod leg", end.Source}} {
			s, ok := streams[leg.from]
			if !ok {
				t.Errorf("%s %s: no stream opened from %s in the capture (streams: %v)", c.name, leg.name, leg.from, streams)
				continue
			}
			toEndpoint, toClient := ocFollow(t, file, s)
			if !bytes.Equal(toEndpoint, c.ex.wantToEndpoint) {
				t.Errorf("%s %s (stream %d) toward the endpoint: %d bytes, want the %d the client sent: %s",
					c.name, leg.name, s, len(toEndpoint), len(c.ex.wantToEndpoint), ocFirstDiff(toEndpoint, c.ex.wantToEndpoint))
			}
			if !bytes.Equal(toClient, c.ex.wantToClient) {
				t.Errorf("%s %s (stream %d) toward the client: %d bytes, want %d of the %d the client received: %s",
					c.name, leg.name, s, len(toClient), len(c.ex.wantToClient), len(c.ex.received), ocFirstDiff(toClient, c.ex.wantToClient))
			}
			if !slices.Equal(uris[s], c.uris) {
				t.Errorf("%s %s (stream %d): HTTP request URIs %q, want %q", c.name, leg.name, s, uris[s], c.uris)
			}
		}
	}
}
