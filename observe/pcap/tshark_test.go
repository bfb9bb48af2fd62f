package pcap

// These tests write captures and read them back with the real tshark: the file must parse with
// no malformed packet and no bad checksum, and "follow TCP stream" must give back exactly the
// bytes each side sent, on both legs.
//
// Address plan (nothing is sent anywhere: the addresses only appear in the synthesized packets):
//   IPv4: client 10.0.0.1, service 10.96.0.10:80 (DNS :53), proxy source 10.0.0.2, pod 10.1.0.5:8080 (DNS :53)
//   IPv6: client fd00::1, service fd00:96::10:80, proxy source fd00::2, pod fd00:1::5:8080

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// t0 is the time the test flows start.
var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

// legs names a flow's addresses.
type legs struct {
	client, service, source, endpoint string
}

var (
	v4 = legs{"10.0.0.1:40000", "10.96.0.10:80", "10.0.0.2:51000", "10.1.0.5:8080"}
	v6 = legs{"[fd00::1]:40001", "[fd00:96::10]:80", "[fd00::2]:51001", "[fd00:1::5]:8080"}
)

// flowItem is a Flow event of flow id at t0+at.
func flowItem(id uint64, proto, phase string, a legs, at time.Duration) *observe.Item {
	f := &observe.Flow{
		Time: t0.Add(at), ID: id, Phase: phase, Verdict: "forwarded", Namespace: "default", Service: "web",
		Port: "http", Protocol: proto, Path: "socket", Client: a.client, ServiceAddress: a.service,
		Endpoint: a.endpoint, EndpointPod: "default/web-1", DurationMicros: at.Microseconds(),
	}
	if phase != "start" || proto == "UDP" {
		f.Source = a.source // TCP: known from Dial on
	}
	return &observe.Item{Flow: f}
}

// endItem is flow id's End event with reason.
func endItem(id uint64, proto, reason, verdict string, a legs, at time.Duration) *observe.Item {
	it := flowItem(id, proto, "end", a, at)
	it.Flow.EndReason, it.Flow.Verdict = reason, verdict
	return it
}

func payloadItem(id uint64, dir string, data []byte, at time.Duration) *observe.Item {
	return &observe.Item{Payload: &observe.Payload{ID: id, Time: t0.Add(at), Direction: dir, Data: data}}
}

// conversation is what a TCP flow's two sides sent.
type conversation struct {
	toEndpoint, toClient []byte
}

// httpFlow is the items of one HTTP exchange on flow id: a request with a body of several
// segments, a response larger than the window (so the receiver must acknowledge on the way),
// both sent in pieces, ended by the client's FIN.
func httpFlow(id uint64, a legs) ([]*observe.Item, conversation) {
	body := bytes.Repeat([]byte("0123456789abcdef"), 5000/16)
	req := append([]byte(fmt.Sprintf("POST /hello?flow=%d HTTP/1.1\r\nHost: web\r\nContent-Length: %d\r\n\r\n", id, len(body))), body...)
	page := bytes.Repeat([]byte("<p>kube-portal-proxy</p>\n"), 4000)
	resp := append([]byte(fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n", len(page))), page...)
	items := []*observe.Item{
		flowItem(id, "TCP", "start", a, 0),
		flowItem(id, "TCP", "dial", a, time.Millisecond),
	}
	at := 2 * time.Millisecond
	for _, p := range split(req, 3000) {
		items = append(items, payloadItem(id, observe.DirToEndpoint, p, at))
		at += time.Millisecond
	}
	items = append(items, flowItem(id, "TCP", "first-byte", a, at))
	for _, p := range split(resp, 16384) {
		items = append(items, payloadItem(id, observe.DirToClient, p, at))
		at += time.Millisecond
	}
	items = append(items, endItem(id, "TCP", "client-closed", "forwarded", a, at))
	return items, conversation{toEndpoint: req, toClient: resp}
}

func split(b []byte, n int) [][]byte {
	var out [][]byte
	for len(b) > n {
		out = append(out, b[:n])
		b = b[n:]
	}
	return append(out, b)
}

// writeCapture writes items to a file and returns its path and the writer's stats.
func writeCapture(t *testing.T, opts Options, items ...*observe.Item) (string, Stats) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "flows.pcapng")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w := NewWriter(f, opts)
	for _, it := range items {
		if err := w.WriteItem(it); err != nil {
			t.Fatalf("WriteItem: %v", err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	return path, w.Stats()
}

// checkPrefs turn on tshark's checksum validation (off by default).
var checkPrefs = []string{"-o", "ip.check_checksum:TRUE", "-o", "tcp.check_checksum:TRUE", "-o", "udp.check_checksum:TRUE"}

// tshark runs tshark on file with args and returns its standard output; any error or output on
// standard error fails the test.
func tshark(t *testing.T, file string, args ...string) string {
	t.Helper()
	bin, err := exec.LookPath("tshark")
	if err != nil {
		testenv.Unavailable(t, "tshark not installed (hack/install-deps.sh test, or apt-get install tshark)")
	}
	cmd := exec.Command(bin, append(append([]string{"-n", "-r", file}, checkPrefs...), args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("tshark %v: %v\n%s", args, err, stderr.String())
	}
	// tshark warns on stderr when run as root; anything else there (a file "cut short in the
	// middle of a packet", a bad preference) fails.
	var complaints []string
	for _, l := range strings.Split(strings.TrimSpace(stderr.String()), "\n") {
		if l != "" && !strings.HasPrefix(l, "Running as user ") {
			complaints = append(complaints, l)
		}
	}
	if len(complaints) > 0 {
		t.Fatalf("tshark %v wrote to stderr:\n%s", args, strings.Join(complaints, "\n"))
	}
	return stdout.String()
}

// fields runs tshark -T fields with the filter and the fields, one []string per packet.
func fields(t *testing.T, file, filter string, names ...string) [][]string {
	t.Helper()
	args := []string{"-Y", filter, "-T", "fields", "-E", "separator=|"}
	for _, n := range names {
		args = append(args, "-e", n)
	}
	var out [][]string
	for _, line := range strings.Split(strings.TrimRight(tshark(t, file, args...), "\n"), "\n") {
		if line != "" {
			out = append(out, strings.Split(line, "|"))
		}
	}
	return out
}

// follow returns what each side sent on TCP stream n, as tshark reassembles it.
func follow(t *testing.T, file string, n int) conversation {
	t.Helper()
	out := tshark(t, file, "-q", "-z", fmt.Sprintf("follow,tcp,raw,%d", n))
	var c conversation
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<20)
	inData := false
	for sc.Scan() {
		line := sc.Text()
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
		dst := &c.toEndpoint // node 0 is the side that sent the first packet: the connecting side
		if strings.HasPrefix(line, "\t") {
			dst = &c.toClient
		}
		b, err := hex.DecodeString(strings.TrimSpace(line))
		if err != nil {
			t.Fatalf("follow stream %d: line %q: %v", n, line, err)
		}
		*dst = append(*dst, b...)
	}
	return c
}

// checkClean fails the test if tshark finds a malformed packet, a bad checksum or any expert
// warning or error (sequence analysis included), except on packets matching allow.
func checkClean(t *testing.T, file, allow string) {
	t.Helper()
	filter := "_ws.malformed || _ws.expert.severity >= warning"
	if allow != "" {
		filter = "(" + filter + ") && !(" + allow + ")"
	}
	if bad := fields(t, file, filter, "frame.number", "_ws.expert.message"); len(bad) > 0 {
		t.Errorf("tshark finds problems (frame|messages): %q", bad)
	}
	for _, p := range fields(t, file, "ip || ipv6", "frame.number", "ip.checksum.status", "tcp.checksum.status", "udp.checksum.status") {
		for _, s := range p[1:] {
			if s != "" && s != "1" { // 1: Good
				t.Errorf("frame %s: checksum status %q (ip|tcp|udp: %q), want 1 (good)", p[0], s, p[1:])
			}
		}
	}
}

func checkFollow(t *testing.T, file string, stream int, want conversation) {
	t.Helper()
	got := follow(t, file, stream)
	if !bytes.Equal(got.toEndpoint, want.toEndpoint) {
		t.Errorf("stream %d to the endpoint: got %d bytes, want %d: %s", stream, len(got.toEndpoint), len(want.toEndpoint), firstDiff(got.toEndpoint, want.toEndpoint))
	}
	if !bytes.Equal(got.toClient, want.toClient) {
		t.Errorf("stream %d to the client: got %d bytes, want %d: %s", stream, len(got.toClient), len(want.toClient), firstDiff(got.toClient, want.toClient))
	}
}

func firstDiff(a, b []byte) string {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return fmt.Sprintf("first difference at byte %d", i)
		}
	}
	return fmt.Sprintf("one is a prefix of the other (%d, %d bytes)", len(a), len(b))
}

// TestTsharkFollowsHTTPOnBothLegs: an HTTP exchange over IPv4 and one over IPv6, each bigger
// than a segment both ways, read back by tshark: no malformed packet, every checksum good, no
// sequence analysis warning, each leg (client's, pod's) reassembles to exactly the bytes sent,
// and the HTTP request is found on each.
func TestTsharkFollowsHTTPOnBothLegs(t *testing.T) {
	items4, conv4 := httpFlow(1, v4)
	items6, conv6 := httpFlow(2, v6)
	file, st := writeCapture(t, Options{}, append(items4, items6...)...)
	if st.Flows != 2 || st.CapReached || st.TruncatedFlows != 0 {
		t.Errorf("stats %+v: want 2 flows, nothing cut", st)
	}
	checkClean(t, file, "")
	// Streams in order of first packet: flow 1's client leg (its Start), flow 1's pod leg (its
	// Dial), then flow 2's.
	for stream, want := range []conversation{conv4, conv4, conv6, conv6} {
		checkFollow(t, file, stream, want)
	}
	got := fields(t, file, "http.request", "tcp.stream", "http.request.method", "http.request.uri")
	want := [][]string{
		{"0", "POST", "/hello?flow=1"}, {"1", "POST", "/hello?flow=1"},
		{"2", "POST", "/hello?flow=2"}, {"3", "POST", "/hello?flow=2"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("HTTP requests (-want +got):\n%s", diff)
	}
	got = fields(t, file, "http.response", "tcp.stream", "http.response.code", "http.content_length")
	want = [][]string{{"0", "200", "100000"}, {"1", "200", "100000"}, {"2", "200", "100000"}, {"3", "200", "100000"}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("HTTP responses (-want +got):\n%s", diff)
	}
	// The legs' addresses: the client's leg between client and service address, the pod's
	// between the proxy's source and the endpoint.
	got = fields(t, file, "tcp.flags.syn == 1 && tcp.flags.ack == 0", "tcp.stream", "ip.src", "ipv6.src", "tcp.srcport", "ip.dst", "ipv6.dst", "tcp.dstport", "frame.comment")
	want = [][]string{
		{"0", "10.0.0.1", "", "40000", "10.96.0.10", "", "80", "flow 1 default/web:http TCP, client leg: client 10.0.0.1:40000 -> service 10.96.0.10:80"},
		{"1", "10.0.0.2", "", "51000", "10.1.0.5", "", "8080", "flow 1 default/web:http TCP, pod leg: proxy 10.0.0.2:51000 -> endpoint default/web-1 10.1.0.5:8080"},
		{"2", "", "fd00::1", "40001", "", "fd00:96::10", "80", "flow 2 default/web:http TCP, client leg: client [fd00::1]:40001 -> service [fd00:96::10]:80"},
		{"3", "", "fd00::2", "51001", "", "fd00:1::5", "8080", "flow 2 default/web:http TCP, pod leg: proxy [fd00::2]:51001 -> endpoint default/web-1 [fd00:1::5]:8080"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("SYNs (-want +got):\n%s", diff)
	}
}

// dnsMessage is a DNS query for name (type A), or its answer with addr.
func dnsMessage(name string, answer []byte) []byte {
	flags, ancount := uint16(0x0100), uint16(0) // a query, recursion desired
	if answer != nil {
		flags, ancount = 0x8180, 1 // a response, recursion available, no error
	}
	m := []byte{0x12, 0x34, byte(flags >> 8), byte(flags), 0, 1, byte(ancount >> 8), byte(ancount), 0, 0, 0, 0}
	for _, label := range strings.Split(name, ".") {
		m = append(m, byte(len(label)))
		m = append(m, label...)
	}
	m = append(m, 0, 0, 1, 0, 1) // root, type A, class IN
	if answer != nil {
		m = append(m, 0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, byte(len(answer))) // the question's name, A, IN, TTL 30
		m = append(m, answer...)
	}
	return m
}

// TestTsharkDecodesUDPDatagramsOnBothLegs: a DNS query and its answer through a UDP flow are one
// datagram each on each leg, with good checksums, and decode as DNS.
func TestTsharkDecodesUDPDatagramsOnBothLegs(t *testing.T) {
	a := legs{"10.0.0.1:40000", "10.96.0.10:53", "10.0.0.2:51000", "10.1.0.5:53"}
	const name = "web.default.svc.cluster.local"
	items := []*observe.Item{
		flowItem(7, "UDP", "start", a, 0),
		payloadItem(7, observe.DirToEndpoint, dnsMessage(name, nil), time.Millisecond),
		payloadItem(7, observe.DirToClient, dnsMessage(name, []byte{10, 1, 0, 5}), 2*time.Millisecond),
		endItem(7, "UDP", "idle-timeout", "timeout", a, time.Minute),
	}
	file, _ := writeCapture(t, Options{}, items...)
	checkClean(t, file, "")
	got := fields(t, file, "", "ip.src", "udp.srcport", "ip.dst", "udp.dstport", "dns.flags.response", "dns.qry.name", "dns.a")
	want := [][]string{
		{"10.0.0.1", "40000", "10.96.0.10", "53", "0", name, ""},
		{"10.0.0.2", "51000", "10.1.0.5", "53", "0", name, ""},
		{"10.96.0.10", "53", "10.0.0.1", "40000", "1", name, "10.1.0.5"},
		{"10.1.0.5", "53", "10.0.0.2", "51000", "1", name, "10.1.0.5"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("datagrams (-want +got):\n%s", diff)
	}
}

// TestTsharkSeesResets: a flow the client reset shows the client's RST on its leg and the
// proxy's on the pod's; one the endpoint reset, the endpoint's and then the proxy's to the
// client; a connection refused for want of an endpoint (its only event is End) is accepted and
// reset by the service address. The bytes before the reset are all there.
func TestTsharkSeesResets(t *testing.T) {
	req := []byte("GET / HTTP/1.1\r\nHost: web\r\n\r\n")
	b := legs{"10.0.0.3:40003", "10.96.0.10:80", "10.0.0.2:51003", "10.1.0.6:8080"}
	c := legs{"10.0.0.4:40004", "10.96.0.10:80", "", ""}
	items := []*observe.Item{
		flowItem(1, "TCP", "start", v4, 0),
		flowItem(1, "TCP", "dial", v4, time.Millisecond),
		payloadItem(1, observe.DirToEndpoint, req, 2*time.Millisecond),
		endItem(1, "TCP", "client-reset", "reset", v4, 3*time.Millisecond),
		flowItem(2, "TCP", "start", b, 4*time.Millisecond),
		flowItem(2, "TCP", "dial", b, 5*time.Millisecond),
		payloadItem(2, observe.DirToEndpoint, req, 6*time.Millisecond),
		endItem(2, "TCP", "endpoint-reset", "reset", b, 7*time.Millisecond),
		endItem(3, "TCP", "no-endpoints", "refused", c, 8*time.Millisecond),
	}
	file, _ := writeCapture(t, Options{}, items...)
	// Connection resets are expert warnings by design; nothing else may be.
	checkClean(t, file, "tcp.flags.reset == 1")
	got := fields(t, file, "tcp.flags.reset == 1", "tcp.stream", "ip.src", "tcp.srcport", "ip.dst", "tcp.dstport", "frame.comment")
	want := [][]string{
		{"0", "10.0.0.1", "40000", "10.96.0.10", "80", "flow 1 end: client-reset, verdict reset"},
		{"1", "10.0.0.2", "51000", "10.1.0.5", "8080", ""},
		{"3", "10.1.0.6", "8080", "10.0.0.2", "51003", "flow 2 end: endpoint-reset, verdict reset"},
		{"2", "10.96.0.10", "80", "10.0.0.3", "40003", ""},
		{"4", "10.96.0.10", "80", "10.0.0.4", "40004", "flow 3 end: no-endpoints, verdict refused"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("resets (-want +got):\n%s", diff)
	}
	for stream := range 4 {
		checkFollow(t, file, stream, conversation{toEndpoint: req})
	}
	if fins := fields(t, file, "tcp.flags.fin == 1", "frame.number"); len(fins) != 0 {
		t.Errorf("reset flows have FINs: frames %q", fins)
	}
}

// TestTsharkTruncatedFlow: a flow cut at its capture cap (the server's, said by Truncated, or
// the Writer's MaxFlowBytes) keeps exactly its first bytes, says so in a comment on the last
// segment of each leg, writes nothing it receives later, and still closes cleanly.
func TestTsharkTruncatedFlow(t *testing.T) {
	up := bytes.Repeat([]byte("u"), 3000)
	down := bytes.Repeat([]byte("d"), 5000)
	for _, tc := range []struct {
		name      string
		opts      Options
		truncated bool // the server marks the second piece as the last it kept
		want      conversation
		comment   string
	}{
		{"server cap", Options{}, true, conversation{up, down},
			"capture truncated: flow 1 reached its capture cap at 8000 bytes; later bytes were not captured"},
		{"writer cap", Options{MaxFlowBytes: 4000}, false, conversation{up, down[:1000]},
			"capture truncated: flow 1 reached its capture cap at 4000 bytes; later bytes were not captured"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			last := payloadItem(1, observe.DirToClient, down, 3*time.Millisecond)
			last.Payload.Truncated = tc.truncated
			items := []*observe.Item{
				flowItem(1, "TCP", "start", v4, 0),
				flowItem(1, "TCP", "dial", v4, time.Millisecond),
				payloadItem(1, observe.DirToEndpoint, up, 2*time.Millisecond),
				last,
				payloadItem(1, observe.DirToEndpoint, []byte("after the cap"), 4*time.Millisecond),
				endItem(1, "TCP", "client-closed", "forwarded", v4, 5*time.Millisecond),
			}
			file, st := writeCapture(t, tc.opts, items...)
			if st.TruncatedFlows != 1 {
				t.Errorf("TruncatedFlows = %d, want 1", st.TruncatedFlows)
			}
			checkClean(t, file, "")
			checkFollow(t, file, 0, tc.want)
			checkFollow(t, file, 1, tc.want)
			got := fields(t, file, `frame.comment contains "truncated"`, "tcp.stream", "tcp.srcport", "tcp.flags.push", "frame.comment")
			want := [][]string{{"0", "80", "1", tc.comment}, {"1", "8080", "1", tc.comment}}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("truncation comments (-want +got):\n%s", diff)
			}
		})
	}
}

// TestTsharkFileCap: with MaxBytes the file stops growing before the cap, packets after it are
// left out and counted, and tshark reads what was written as a whole, valid file.
func TestTsharkFileCap(t *testing.T) {
	items, _ := httpFlow(1, v4)
	const limit = 20000
	file, st := writeCapture(t, Options{MaxBytes: limit}, items...)
	fi, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() > limit || fi.Size() != st.Bytes {
		t.Errorf("file is %d bytes, stats say %d; want them equal and at most %d", fi.Size(), st.Bytes, limit)
	}
	if !st.CapReached || st.PacketsOverCap == 0 {
		t.Errorf("stats %+v: want the cap reached and packets left out", st)
	}
	checkClean(t, file, "")
	if n := len(fields(t, file, "", "frame.number")); int64(n) != st.Packets || n == 0 {
		t.Errorf("tshark reads %d packets, the writer wrote %d", n, st.Packets)
	}
}

// TestTsharkPayloadBeforeItsFlow: payload that arrives before any event of its flow (its Start
// and Dial were lost) waits for the flow's End, which opens the client's leg at the flow's start
// (End's time less its duration) and the pod's at the first payload; the bytes come out exact. Payload whose flow never shows up is dropped and counted, and so is
// payload beyond the waiting bound.
func TestTsharkPayloadBeforeItsFlow(t *testing.T) {
	req, resp := []byte("GET /late HTTP/1.1\r\nHost: web\r\n\r\n"), []byte("HTTP/1.1 204 No Content\r\n\r\n")
	orphan := bytes.Repeat([]byte("o"), 100)
	items := []*observe.Item{
		payloadItem(1, observe.DirToEndpoint, req, 2*time.Millisecond),
		payloadItem(9, observe.DirToEndpoint, orphan, 2*time.Millisecond),         // its flow never comes
		payloadItem(9, observe.DirToEndpoint, orphan, 2*time.Millisecond),         // past the bound
		payloadItem(1, observe.DirToClient, resp, 3*time.Millisecond),             // within it: the bound leaves room for it
		endItem(1, "TCP", "endpoint-closed", "forwarded", v4, 4*time.Millisecond), // Duration 4ms: started at 0
	}
	bound := len(req) + len(orphan) + len(resp) + 3*pendingItemCost
	file, st := writeCapture(t, Options{PendingBytes: bound}, items...)
	if st.UnmatchedPayloadBytes != 200 {
		t.Errorf("UnmatchedPayloadBytes = %d, want 200 (flow 9's two pieces)", st.UnmatchedPayloadBytes)
	}
	checkClean(t, file, "")
	checkFollow(t, file, 0, conversation{req, resp})
	checkFollow(t, file, 1, conversation{req, resp})
	got := fields(t, file, "tcp.flags.syn == 1 && tcp.flags.ack == 0", "tcp.stream", "frame.time_epoch")
	start, dial := fmt.Sprintf("%d.000000000", t0.Unix()), fmt.Sprintf("%d.002000000", t0.Unix())
	if diff := cmp.Diff([][]string{{"0", start}, {"1", dial}}, got); diff != "" {
		t.Errorf("SYNs (-want +got):\n%s", diff)
	}
	// The endpoint closed first: its FIN on the pod's leg comes first, then the proxy's to the client.
	got = fields(t, file, "tcp.flags.fin == 1", "tcp.stream", "tcp.srcport")
	if diff := cmp.Diff([][]string{{"1", "8080"}, {"1", "51000"}, {"0", "80"}, {"0", "40000"}}, got); diff != "" {
		t.Errorf("FINs (-want +got):\n%s", diff)
	}
}

// TestFlowsOfTwoNodesWithOneID: flow IDs are unique per proxy only, so a stream merged from two
// nodes may carry one ID twice: the flows stay apart.
func TestFlowsOfTwoNodesWithOneID(t *testing.T) {
	b := legs{"10.0.0.3:40003", "10.96.0.10:80", "10.0.0.7:51003", "10.1.0.6:8080"}
	req := []byte("GET / HTTP/1.1\r\n\r\n")
	var items []*observe.Item
	for _, n := range []struct {
		node string
		a    legs
	}{{"node-a", v4}, {"node-b", b}} {
		for _, it := range []*observe.Item{
			flowItem(1, "TCP", "start", n.a, 0),
			flowItem(1, "TCP", "dial", n.a, time.Millisecond),
			payloadItem(1, observe.DirToEndpoint, req, 2*time.Millisecond),
		} {
			if it.Flow != nil {
				it.Flow.Node = n.node
			} else {
				it.Payload.Node = n.node
			}
			items = append(items, it)
		}
	}
	file, st := writeCapture(t, Options{}, items...)
	if st.Flows != 2 {
		t.Errorf("Flows = %d, want 2", st.Flows)
	}
	checkClean(t, file, "")
	for stream := range 4 {
		checkFollow(t, file, stream, conversation{toEndpoint: req})
	}
}

// TestTsharkReadsAnEmptyCapture: a capture closed before any flow (or with a cap below its
// header) is a valid file with no packet.
func TestTsharkReadsAnEmptyCapture(t *testing.T) {
	items, _ := httpFlow(1, v4)
	file, st := writeCapture(t, Options{MaxBytes: 1}, items...)
	if st.Packets != 0 || !st.CapReached {
		t.Errorf("stats %+v: want no packet and the cap reached", st)
	}
	if out := tshark(t, file); out != "" {
		t.Errorf("tshark lists packets:\n%s", out)
	}
}
