package cli

// Address plan: fake proxies listen on 127.0.0.1 (--address) or, one per fake Node, on the same
// port of 127.0.0.2, 127.0.0.3, ... (the Nodes' InternalIPs). The flows they serve name cluster
// addresses (10.244.x pods, 10.96.x services) that no socket uses.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	fakeclock "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// syncBuffer is a bytes.Buffer safe to read while the command writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type result struct {
	code           int
	stdout, stderr string
}

// observeCmd runs the command with env (Stdout and Stderr are set here; times print in UTC).
func observeCmd(ctx context.Context, env Env, args ...string) result {
	var stdout, stderr syncBuffer
	env.Stdout, env.Stderr = &stdout, &stderr
	if env.Location == nil {
		env.Location = time.UTC
	}
	code := Main(ctx, args, env)
	return result{code, stdout.String(), stderr.String()}
}

// TestQueryFromFlags: each flag becomes the protocol's query parameter, allow and deny.
func TestQueryFromFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // url.Values.Encode: sorted by key
	}{
		{"default_one_line_per_flow", nil, "phase=end"},
		{"all_phases", []string{"--phase", "all"}, ""},
		{"two_phases", []string{"--phase", "start,end"}, "phase=start&phase=end"},
		{"follow_last_since_rate", []string{"-f", "--last", "10", "--since", "5m", "--max-rps", "100"},
			"follow=1&last=10&phase=end&rate=100&since=5m"},
		{"last_zero_is_sent", []string{"--last=0"}, "last=0&phase=end"},
		{"since_rfc3339", []string{"--since", "2026-07-01T12:00:00Z"}, "phase=end&since=2026-07-01T12%3A00%3A00Z"},
		{"allow_filters", []string{"-n", "default,shop", "--service", "default/web", "--pod", "default/web-",
			"--client", "10.244.0.0/16", "--to-port", "http", "--protocol", "TCP", "--verdict", "refused", "--verdict", "reset", "--path", "socket"},
			"client=10.244.0.0%2F16&namespace=default&namespace=shop&path=socket&phase=end&pod=default%2Fweb-&port=http&protocol=tcp&service=default%2Fweb&verdict=refused&verdict=reset"},
		{"deny_filters", []string{"--not-namespace", "kube-system", "--not-service", "web", "--not-pod", "x/y",
			"--not-client", "10.0.0.1", "--not-to-port", "53", "--not-protocol", "udp", "--not-verdict", "forwarded", "--not-path", "kernel", "--phase", "all", "--not-phase", "held"},
			"not-client=10.0.0.1&not-namespace=kube-system&not-path=kernel&not-phase=held&not-pod=x%2Fy&not-port=53&not-protocol=udp&not-service=web&not-verdict=forwarded"},
		{"capture", []string{"--pcap", "out.pcapng", "--capture-bytes", "4096"}, "capture=1&capture_bytes=4096&phase=end"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := Parse(tt.args, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			if got := o.Query.Encode(); got != tt.want {
				t.Errorf("query\n got %s\nwant %s", got, tt.want)
			}
		})
	}
}

// TestQueryReachesTheProxy: the command asks the --address proxy for NDJSON with the flags' query.
func TestQueryReachesTheProxy(t *testing.T) {
	p := newFakeProxy(t, webFlow("node-a", 0))
	addr := serveLocal(t, p)
	r := observeCmd(context.Background(), Env{}, "--address", addr, "--service", "default/web", "--not-verdict", "forwarded", "--last", "5")
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	reqs := p.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1", len(reqs))
	}
	if got, want := reqs[0].URL.String(), "/debug/flows?last=5&not-verdict=forwarded&phase=end&service=default%2Fweb"; got != want {
		t.Errorf("request URL %s, want %s", got, want)
	}
	if got := reqs[0].Header.Get("Accept"); got != "application/x-ndjson" {
		t.Errorf("Accept %q, want application/x-ndjson", got)
	}
	if got := reqs[0].Header.Get("Authorization"); got != "" {
		t.Errorf("the local address got credentials: Authorization %q", got)
	}
}

// TestOutput prints the same stream as a table, wide and json, and checks every line.
func TestOutput(t *testing.T) {
	items := []observe.Item{webFlow("node-a", 0), refusedFlow("node-a", 5), lostItem("node-a", 6, 12, observe.LostSlow),
		dialFailedFlow("node-a", 3010)}
	tests := []struct {
		output string
		want   []string
	}{
		{"table", []string{
			"TIME          NODE    SERVICE           CLIENT -> ENDPOINT (POD)                                VERDICT      PHASE  DURATION  BYTES",
			"12:00:01.234  node-a  default/web:http  10.244.1.7:43512 -> 10.244.2.9:8080 (web-5f7b9c-x2x9q)  forwarded    end      12.3ms  78B/1.2kB",
			"12:00:01.239  node-a  default/web:http  10.244.1.7:43514 -> -                                   refused      end           -  0B/0B",
			"12:00:04.244  node-a  shop/api          10.244.1.8:40000 -> 10.244.3.4:8080 (api-0)             dial-failed  end          3s  0B/0B",
		}},
		{"wide", []string{
			"TIME          NODE    SERVICE           CLIENT (POD) -> ENDPOINT (POD)                          VERDICT      PHASE  DURATION  BYTES      EP-NODE  PICK                     DIALS  CONNECT  1ST-BYTE  REASON         ERROR",
			"12:00:01.234  node-a  default/web:http  10.244.1.7:43512 -> 10.244.2.9:8080 (web-5f7b9c-x2x9q)  forwarded    end      12.3ms  78B/1.2kB  node-b   round-robin                  1    850µs     1.2ms  client-closed  -",
			"12:00:01.239  node-a  default/web:http  10.244.1.7:43514 (curl) -> -                            refused      end           -  0B/0B      -        -                            -        -         -  no-endpoints   -",
			"12:00:04.244  node-a  shop/api          10.244.1.8:40000 -> 10.244.3.4:8080 (api-0)             dial-failed  end          3s  0B/0B      node-c   least-connections+retry      3        -         -  dial-failed    dial tcp 10.244.3.4:8080: connect: connection refused",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.output, func(t *testing.T) {
			addr := serveLocal(t, newFakeProxy(t, items...))
			r := observeCmd(context.Background(), Env{}, "--address", addr, "-o", tt.output, "--color", "never")
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			if diff := cmp.Diff(tt.want, lines(r.stdout)); diff != "" {
				t.Errorf("stdout (-want +got):\n%s", diff)
			}
			if want := "lost 12 events on node-a: slow observer (the proxy's ring overtook this stream)\n"; r.stderr != want {
				t.Errorf("stderr %q, want %q", r.stderr, want)
			}
		})
	}
	t.Run("json", func(t *testing.T) {
		p := newFakeProxy(t, items...)
		addr := serveLocal(t, p)
		r := observeCmd(context.Background(), Env{}, "--address", addr, "-o", "json")
		if r.code != 0 {
			t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
		}
		var want []string
		for _, l := range p.lines {
			want = append(want, string(l))
		}
		if diff := cmp.Diff(want, lines(r.stdout)); diff != "" {
			t.Errorf("stdout is not the stream's items verbatim (-want +got):\n%s", diff)
		}
		if !strings.Contains(r.stderr, "lost 12 events on node-a: slow observer") {
			t.Errorf("stderr %q lacks the lost events", r.stderr)
		}
	})
}

func lines(s string) []string {
	return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
}

// TestColor colours the verdict only: green forwarded, red refused and dial-failed; never, and
// auto on a pipe, print plain text.
func TestColor(t *testing.T) {
	addr := serveLocal(t, newFakeProxy(t, webFlow("node-a", 0), refusedFlow("node-a", 5), dialFailedFlow("node-a", 6),
		observe.Item{Flow: &observe.Flow{Time: at(7), Phase: "end", Verdict: "timeout", Namespace: "a", Service: "b"}}))
	r := observeCmd(context.Background(), Env{}, "--address", addr, "--color", "always")
	for _, want := range []string{"  \x1b[32mforwarded\x1b[0m    end", "\x1b[31mrefused\x1b[0m", "\x1b[31mdial-failed\x1b[0m", "\x1b[33mtimeout\x1b[0m"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("--color=always: stdout lacks %q:\n%s", want, r.stdout)
		}
	}
	for _, mode := range []string{"never", "auto"} {
		r := observeCmd(context.Background(), Env{}, "--address", addr, "--color", mode)
		if r.code != 0 || strings.Contains(r.stdout, "\x1b[") {
			t.Errorf("--color=%s (stdout not a terminal): exit %d, escape codes in\n%q", mode, r.code, r.stdout)
		}
	}
}

// TestLost names each reason on stderr, with the stream's node when the item has none.
func TestLost(t *testing.T) {
	addr := serveLocal(t, newFakeProxy(t, lostItem("", 0, 3, observe.LostRate), lostItem("node-b", 1, 1, observe.LostSlow),
		lostItem("", 2, 2, "something-new")))
	r := observeCmd(context.Background(), Env{}, "--address", addr)
	want := "lost 3 events: rate cap (--max-rps or the proxy's limit)\n" +
		"lost 1 events on node-b: slow observer (the proxy's ring overtook this stream)\n" +
		"lost 2 events: something-new\n" +
		"No flows.\n"
	if r.stderr != want || r.stdout != "" || r.code != 0 {
		t.Errorf("exit %d, stdout %q, stderr:\n%s\nwant:\n%s", r.code, r.stdout, r.stderr, want)
	}
}

// TestNodeURLAndAuthorization: --node reads the Node's InternalIP and sends the kubeconfig's token.
func TestNodeURLAndAuthorization(t *testing.T) {
	a, b := newFakeProxy(t, webFlow("node-a", 0)), newFakeProxy(t, webFlow("node-b", 0))
	port := serveNodes(t, a, b)
	env := Env{NewClientset: fakeClientset(node("node-a", 0), node("node-b", 1))}
	r := observeCmd(context.Background(), env, "--node", "node-b", "--kubeconfig", writeKubeconfig(t, "tok-123"),
		"--port", strconv.Itoa(port), "--service", "default/web", "-o", "json")
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	if n := len(a.requests()); n != 0 {
		t.Errorf("node-a's proxy got %d requests, want 0", n)
	}
	reqs := b.requests()
	if len(reqs) != 1 {
		t.Fatalf("node-b's proxy got %d requests, want 1", len(reqs))
	}
	got := "http://" + reqs[0].Host + reqs[0].URL.String()
	if want := fmt.Sprintf("http://127.0.0.3:%d/debug/flows?phase=end&service=default%%2Fweb", port); got != want {
		t.Errorf("URL %s, want %s", got, want)
	}
	if got := reqs[0].Header.Get("Authorization"); got != "Bearer tok-123" {
		t.Errorf("Authorization %q, want the kubeconfig's token", got)
	}

	r = observeCmd(context.Background(), env, "--node", "node-x", "--kubeconfig", writeKubeconfig(t, "tok-123"))
	if want := `kube-portal-proxy observe: get node node-x: nodes "node-x" not found`; r.code != 1 || !strings.Contains(r.stderr, want) {
		t.Errorf("unknown node: exit %d, stderr %q; want 1 and %q", r.code, r.stderr, want)
	}
}

// TestAllNodesMergedByTime: every Node's stream, merged into one ordered by time; collected then
// sorted without --follow, merged by watermark with it.
func TestAllNodesMergedByTime(t *testing.T) {
	want := []string{
		"12:00:01.234  node-a", "12:00:01.236  node-b", "12:00:01.239  node-a", "12:00:01.244  node-b", "12:00:04.244  node-a",
	}
	for _, follow := range []bool{false, true} {
		t.Run(fmt.Sprintf("follow=%v", follow), func(t *testing.T) {
			a := newFakeProxy(t, webFlow("node-a", 0), refusedFlow("node-a", 5), dialFailedFlow("node-a", 3010))
			b := newFakeProxy(t, webFlow("node-b", 2), refusedFlow("node-b", 10))
			port := serveNodes(t, a, b)
			// The fake clock never moves: in follow mode only watermarks release items, so the order
			// does not depend on which stream the command reads first.
			env := Env{NewClientset: fakeClientset(node("node-b", 1), node("node-a", 0)), Clock: fakeclock.NewFakeClock(t0)}
			args := []string{"--all-nodes", "--kubeconfig", writeKubeconfig(t, "tok"), "--port", strconv.Itoa(port)}
			if follow {
				args = append(args, "--follow")
			}
			r := observeCmd(context.Background(), env, args...)
			if r.code != 0 {
				t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
			}
			var got []string
			for _, l := range lines(r.stdout)[1:] {
				got = append(got, l[:20])
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("merged rows (-want +got):\n%s\n%s", diff, r.stdout)
			}
			for _, p := range []*fakeProxy{a, b} {
				if reqs := p.requests(); len(reqs) != 1 || reqs[0].Header.Get("Authorization") != "Bearer tok" {
					t.Errorf("want one request with the token per node, got %d", len(reqs))
				}
			}
		})
	}
	t.Run("last_of_all", func(t *testing.T) {
		a := newFakeProxy(t, webFlow("node-a", 0), refusedFlow("node-a", 5))
		b := newFakeProxy(t, webFlow("node-b", 2), refusedFlow("node-b", 10))
		port := serveNodes(t, a, b)
		env := Env{NewClientset: fakeClientset(node("node-a", 0), node("node-b", 1))}
		r := observeCmd(context.Background(), env, "--all-nodes", "--kubeconfig", writeKubeconfig(t, "tok"), "--port", strconv.Itoa(port), "--last", "2")
		var got []string
		for _, l := range lines(r.stdout)[1:] {
			got = append(got, l[:20])
		}
		if diff := cmp.Diff([]string{"12:00:01.239  node-a", "12:00:01.244  node-b"}, got); diff != "" {
			t.Errorf("--last 2 over two nodes (-want +got):\n%s", diff)
		}
	})
}

// TestAllNodesReadsEachAddressOnce: two Node objects with one InternalIP (a stale Node, a test
// lab's copies) are one proxy: it is read once, so its flows do not come twice.
func TestAllNodesReadsEachAddressOnce(t *testing.T) {
	a := newFakeProxy(t, webFlow("node-a", 0), refusedFlow("node-a", 5))
	b := newFakeProxy(t, webFlow("node-b", 2), refusedFlow("node-b", 10))
	port := serveNodes(t, a, b)
	env := Env{NewClientset: fakeClientset(node("node-a", 0), node("node-b", 1), node("stale-b", 1))}
	r := observeCmd(context.Background(), env, "--all-nodes", "--kubeconfig", writeKubeconfig(t, "tok"), "--port", strconv.Itoa(port), "--last", "2")
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	var got []string
	for _, l := range lines(r.stdout)[1:] {
		got = append(got, l[:20])
	}
	if diff := cmp.Diff([]string{"12:00:01.239  node-a", "12:00:01.244  node-b"}, got); diff != "" {
		t.Errorf("--last 2 with a second Node on node-b's address (-want +got):\n%s", diff)
	}
	if n := len(b.requests()); n != 1 {
		t.Errorf("node-b's proxy read %d times, want once", n)
	}
}

// TestAllNodesOneFails: a node whose proxy fails is reported and the others go on; exit 1 only
// when every node fails.
func TestAllNodesOneFails(t *testing.T) {
	a := newFakeProxy(t, webFlow("node-a", 0))
	b := newFakeProxy(t)
	b.status, b.body = 403, `user "alice" cannot get nodes/flows "node-b"`
	port := serveNodes(t, a, b)
	env := Env{NewClientset: fakeClientset(node("node-a", 0), node("node-b", 1))}
	kc := writeKubeconfig(t, "tok")
	r := observeCmd(context.Background(), env, "--all-nodes", "--kubeconfig", kc, "--port", strconv.Itoa(port))
	wantErr := fmt.Sprintf(`kube-portal-proxy observe: node node-b: GET http://127.0.0.3:%d/debug/flows?phase=end: 403 Forbidden: user "alice" cannot get nodes/flows "node-b"`, port)
	if r.code != 0 || !strings.Contains(r.stderr, wantErr) || len(lines(r.stdout)) != 2 {
		t.Errorf("one node failing: exit %d, stdout:\n%s\nstderr %q; want 0, node-a's row and %q", r.code, r.stdout, r.stderr, wantErr)
	}
	a.status, a.body = 500, "boom"
	r = observeCmd(context.Background(), env, "--all-nodes", "--kubeconfig", kc, "--port", strconv.Itoa(port))
	if r.code != 1 || !strings.Contains(r.stderr, "every node's stream failed") {
		t.Errorf("every node failing: exit %d, stderr %q; want 1", r.code, r.stderr)
	}
}

// TestFollowStopsOnCancel: a followed stream runs until ctx is done (SIGINT), then the command
// returns 0 and the server sees the request go.
func TestFollowStopsOnCancel(t *testing.T) {
	a, b := newFakeProxy(t, webFlow("node-a", 0)), newFakeProxy(t, webFlow("node-b", 1))
	a.hold, b.hold = true, true
	port := serveNodes(t, a, b)
	env := Env{NewClientset: fakeClientset(node("node-a", 0), node("node-b", 1))}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan result, 1)
	go func() {
		done <- observeCmd(ctx, env, "--all-nodes", "--kubeconfig", writeKubeconfig(t, "tok"), "--port", strconv.Itoa(port), "-f")
	}()
	for _, p := range []*fakeProxy{a, b} {
		select {
		case <-p.sent:
		case <-time.After(10 * time.Second):
			t.Fatal("the command did not open both streams")
		}
	}
	cancel()
	select {
	case r := <-done:
		if r.code != 0 {
			t.Errorf("exit %d after cancel, stderr %q; want 0", r.code, r.stderr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the command did not stop on cancel")
	}
}

// TestPCAP: --pcap asks for capture and hands the capture writer the flows and payloads, then
// closes it.
func TestPCAP(t *testing.T) {
	payload := observe.Item{Payload: &observe.Payload{ID: 41, Time: at(1), Direction: observe.DirToEndpoint, Data: []byte("GET / HTTP/1.1\r\n\r\n")}}
	p := newFakeProxy(t, webFlow("node-a", 0), payload, lostItem("", 2, 1, observe.LostSlow))
	addr := serveLocal(t, p)
	cw := &fakeCapture{}
	var opened io.Writer
	env := Env{NewCapture: func(w io.Writer) (CaptureWriter, error) { opened = w; return cw, nil }}
	file := filepath.Join(t.TempDir(), "out.pcapng")
	r := observeCmd(context.Background(), env, "--address", addr, "--pcap", file, "--capture-bytes", "100")
	if r.code != 0 {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	if q := p.requests()[0].URL.Query(); q.Get("capture") != "1" || q.Get("capture_bytes") != "100" {
		t.Errorf("query %v lacks capture=1&capture_bytes=100", q)
	}
	if f, ok := opened.(*os.File); !ok || f.Name() != file {
		t.Errorf("capture opened on %v, want the file %s", opened, file)
	}
	if len(cw.items) != 2 || cw.items[0].Flow == nil || string(cw.items[1].Payload.Data) != "GET / HTTP/1.1\r\n\r\n" || !cw.closed {
		t.Errorf("capture got %+v (closed %v), want the flow and the payload, then Close", cw.items, cw.closed)
	}

	r = observeCmd(context.Background(), Env{}, "--address", addr, "--pcap", file)
	if r.code != 2 || !strings.Contains(r.stderr, "--pcap: this build cannot write captures") {
		t.Errorf("no capture writer: exit %d, stderr %q", r.code, r.stderr)
	}
}

type fakeCapture struct {
	items  []observe.Item
	closed bool
}

func (c *fakeCapture) WriteItem(it *observe.Item) error { c.items = append(c.items, *it); return nil }
func (c *fakeCapture) Close() error                     { c.closed = true; return nil }

// TestBadFlags exit 2 with a message naming the flag, before any connection.
func TestBadFlags(t *testing.T) {
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"--no-such"}, "unknown flag: --no-such"},
		{[]string{"extra"}, `unexpected arguments: ["extra"]`},
		{[]string{"--verdict", "ok"}, `--verdict: unknown verdict "ok"`},
		{[]string{"--not-verdict", "ok"}, `--not-verdict: unknown verdict "ok"`},
		{[]string{"--phase", "begin"}, `--phase: unknown phase "begin"`},
		{[]string{"--phase", "all,end"}, "--phase: all cannot be combined"},
		{[]string{"--protocol", "sctp"}, `--protocol: "sctp": want tcp or udp`},
		{[]string{"--client", "10.0.0.300"}, `--client: "10.0.0.300": want an IP address or a CIDR`},
		{[]string{"--service", "a/"}, `--service: "a/": want namespace/name or name`},
		{[]string{"--path", "fast"}, `--path: "fast": want socket or kernel`},
		{[]string{"--since", "yesterday"}, `--since: "yesterday": want a duration`},
		{[]string{"--since", "-5m"}, "--since: \"-5m\": a duration must not be negative"},
		{[]string{"--last", "-1"}, "--last: -1: want >= 0"},
		{[]string{"-o", "yaml"}, `--output: "yaml": want table, wide or json`},
		{[]string{"--color", "yes"}, `--color: "yes": want auto, always or never`},
		{[]string{"--node", "a", "--all-nodes"}, "--node and --all-nodes: choose one"},
		{[]string{"--node", "a", "--address", "127.0.0.1:1"}, "--address and --node/--all-nodes: choose one"},
		{[]string{"--scheme", "ftp"}, `--scheme: "ftp": want http or https`},
		{[]string{"--port", "0"}, "--port: 0 is not a port"},
		{[]string{"--insecure-skip-tls-verify", "--certificate-authority", "ca.pem"}, "choose one"},
		{[]string{"--capture-bytes", "10"}, "--capture-bytes needs --pcap"},
		{[]string{"--max-rps", "-1"}, "--max-rps: -1: want >= 0"},
		{[]string{"--address", "localhost"}, `--address: "localhost": want host:port`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := observeCmd(context.Background(), Env{}, tt.args...)
			if r.code != 2 || !strings.HasPrefix(r.stderr, "kube-portal-proxy observe: ") || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("exit %d, stderr %q; want 2 and %q", r.code, r.stderr, tt.want)
			}
		})
	}
}

// TestFlowsURL: --address is host:port, or a base URL.
func TestFlowsURL(t *testing.T) {
	q := url.Values{"phase": {"end"}}
	for _, tt := range []struct{ scheme, addr, want string }{
		{"http", "127.0.0.1:10249", "http://127.0.0.1:10249/debug/flows?phase=end"},
		{"https", "[fd00::1]:10249", "https://[fd00::1]:10249/debug/flows?phase=end"},
		{"http", "https://proxy.example:8443/kpp", "https://proxy.example:8443/kpp/debug/flows?phase=end"},
	} {
		if got := flowsURL(tt.scheme, tt.addr, q); got != tt.want {
			t.Errorf("flowsURL(%s, %s) = %s, want %s", tt.scheme, tt.addr, got, tt.want)
		}
	}
}

// TestHumanUnits: durations with at most 3 significant digits, bytes in SI units.
func TestHumanUnits(t *testing.T) {
	for us, want := range map[int64]string{0: "-", 7: "7µs", 850: "850µs", 1000: "1ms", 1234: "1.2ms", 12345: "12.3ms",
		123456: "123ms", 999_999: "1000ms", 1_500_000: "1.5s", 59_000_000: "59s", 65_400_000: "1m5s", 7_200_000_000: "2h0m0s"} {
		if got := micros(us); got != want {
			t.Errorf("micros(%d) = %q, want %q", us, got, want)
		}
	}
	for n, want := range map[uint64]string{0: "0B", 999: "999B", 1000: "1kB", 1234: "1.2kB", 12_345: "12kB", 3_400_000: "3.4MB", 5e9: "5GB"} {
		if got := bytesText(n); got != want {
			t.Errorf("bytesText(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestMergerWindow: an item waits for the other open streams to reach its time, or for the
// reorder window when one stays quiet; a closed stream holds nothing back.
func TestMergerWindow(t *testing.T) {
	clk := fakeclock.NewFakeClock(t0)
	m := newMerger(2, 250*time.Millisecond)
	flowAt := func(src, ms int) item { return item{Item: webFlow("", ms), src: src} }
	times := func(its []item) (out []int) {
		for _, it := range its {
			out = append(out, int(it.time().Sub(t0)/time.Millisecond))
		}
		return out
	}
	m.add(flowAt(0, 10), clk.Now())
	m.add(flowAt(0, 20), clk.Now())
	if out, wait := m.ready(clk.Now()); len(out) != 0 || wait != 250*time.Millisecond {
		t.Fatalf("stream 1 silent: released %v, wait %v; want nothing for 250ms", times(out), wait)
	}
	m.add(flowAt(1, 15), clk.Now())
	if out, _ := m.ready(clk.Now()); !cmp.Equal(times(out), []int{10, 15}) {
		t.Errorf("stream 1 at 15ms: released %v, want [10 15]", times(out))
	}
	clk.Step(100 * time.Millisecond)
	if out, wait := m.ready(clk.Now()); len(out) != 0 || wait != 150*time.Millisecond {
		t.Errorf("100ms later: released %v, wait %v; want nothing for 150ms more", times(out), wait)
	}
	clk.Step(150 * time.Millisecond)
	if out, _ := m.ready(clk.Now()); !cmp.Equal(times(out), []int{20}) {
		t.Errorf("after the window: released %v, want [20]", times(out))
	}
	m.add(flowAt(0, 30), clk.Now())
	m.close(1)
	if out, wait := m.ready(clk.Now()); !cmp.Equal(times(out), []int{30}) || wait != 0 {
		t.Errorf("stream 1 closed: released %v, wait %v; want [30] and nothing queued", times(out), wait)
	}
}
