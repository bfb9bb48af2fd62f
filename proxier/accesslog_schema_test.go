package proxier

// Address plan: loopback only. A TCP echo backend, a TCP port nothing listens on, a UDP echo
// backend; the proxies listen on 127.0.0.1, kernel-chosen ports.

import (
	"context"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
	"github.com/kube-portal-proxy/kube-portal-proxy/udp"
)

// TestAccessLogLinesMatchSchema checks accesslog.schema.json, the documented format log
// pipelines parse, against lines the access log writes with the JSON formatter --log-format=json
// uses, for real connections through real loopback proxies: a TCP connection to a known pod, a
// TCP connection whose every dial fails, and a UDP session that idles out.
// everyDialTransparent is a source policy that dials every endpoint from the client's address.
type everyDialTransparent struct{}

func (everyDialTransparent) Transparent(_, _ netip.Addr) bool { return true }

func TestAccessLogLinesMatchSchema(t *testing.T) {
	schema, err := testenv.LoadJSONSchema("accesslog.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	out := &testenv.SyncBuffer{} // the JSON lines the logger writes, across the proxies' goroutines
	log := logrus.New()
	log.SetOutput(out)
	log.SetFormatter(&logrus.JSONFormatter{})
	quiet := logrus.New() // the sockets' own warnings (the failed dials)
	quiet.SetOutput(io.Discard)
	pods := NewPodIndex()
	al := AccessLog{All: true, Log: log, Pods: pods}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()

	echo := testenv.EchoTCP(t)
	web := &service.Port{Name: testenv.PortName("default", "web", "http"), Protocol: service.TCP}
	dead := &service.Port{Name: testenv.PortName("default", "dead", ""), Protocol: service.TCP}
	dns := &service.Port{Name: testenv.PortName("kube-system", "kube-dns", "dns"), Protocol: service.UDP}
	pods.watch(web.Name)
	pods.update(web.Name, []service.Endpoint{{Addr: echo, NodeName: "node-1", TargetRef: service.NamespacedName{Namespace: "default", Name: "web-0"}}})

	// The web port dials transparently (a policy that always says so): on loopback the echo's
	// replies to the client's address and port reach the proxy's socket without any plumbing, the
	// 4-tuple picks it over the client's own; the client sets SO_REUSEADDR so the proxy's bind
	// may share its port.
	startTCP := func(port *service.Port, ep netip.AddrPort) netip.AddrPort {
		cfg := tcp.Config{OnEnd: al.OnEnd(port), Logger: quiet}
		if port == web {
			cfg.Source = everyDialTransparent{}
		}
		p := tcp.New(port.Name, onePicker{ep}, cfg)
		if err := p.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
			t.Fatal(err)
		}
		go p.Run(ctx)
		t.Cleanup(p.Shutdown)
		return p.Addr()
	}
	webAddr := startTCP(web, echo)
	deadAddr := startTCP(dead, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), testenv.FreeTCPPort(t, "127.0.0.1")))

	// The UDP session idles out on a fake clock, stepped once the reply is in: on the real clock a
	// 100 ms idle timeout ended the session before a loaded machine (-race, -count=50) had the
	// echo's reply through it, and the read below timed out (1 run in 50).
	const idle = 100 * time.Millisecond
	fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	u := udp.New(dns.Name, onePicker{testenv.EchoUDP(t)}, udp.Config{IdleTimeout: idle, Clock: fc, OnEnd: al.OnEnd(dns), Logger: quiet})
	if err := u.Listen(netip.MustParseAddrPort("127.0.0.1:0")); err != nil {
		t.Fatal(err)
	}
	go u.Run(ctx)
	t.Cleanup(u.Shutdown)

	// TCP: one exchange, then the client closes.
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1) }); err != nil {
			return err
		}
		return serr
	}}
	c, err := d.Dial("tcp4", webAddr.String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	c.Close()
	// TCP: every dial fails, the proxy closes.
	if c, err := net.Dial("tcp4", deadAddr.String()); err == nil {
		_ = c.SetReadDeadline(time.Now().Add(testenv.WaitTimeout))
		_, _ = c.Read(make([]byte, 1))
		c.Close()
	}
	// UDP: one exchange, then the session idles out.
	uc, err := net.Dial("udp4", u.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	if _, err := uc.Write([]byte("query")); err != nil {
		t.Fatal(err)
	}
	_ = uc.SetReadDeadline(time.Now().Add(testenv.WaitTimeout))
	if _, err := uc.Read(make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "UDP expiry timer armed", fc.HasWaiters)
	fc.Step(2 * idle)

	testenv.WaitFor(t, "three access log lines", func() bool { return len(out.Lines()) >= 3 })
	seen := map[string]bool{}
	for _, line := range out.Lines() {
		if err := schema.Validate([]byte(line)); err != nil {
			t.Errorf("access log line does not match the schema: %v", err)
		}
		for _, want := range []string{`"reason":"client-closed"`, `"reason":"dial-failed"`, `"reason":"idle-timeout"`, `"pod":"default/web-0"`, `"error":`, `"source":"client"`} {
			if strings.Contains(line, want) {
				seen[want] = true
			}
		}
	}
	for _, want := range []string{`"reason":"client-closed"`, `"reason":"dial-failed"`, `"reason":"idle-timeout"`, `"pod":"default/web-0"`, `"error":`, `"source":"client"`} {
		if !seen[want] {
			t.Errorf("no line has %s: %q", want, out.Lines())
		}
	}

	// The schema is no rubber stamp: lines that break the format are rejected.
	for _, bad := range []string{
		`{"time":"2026-01-01T00:00:00Z","level":"info","msg":"connection closed","access":"tcp","client":"10.0.0.1:1234","endpoint":"none","bytes_to_endpoint":0,"bytes_to_client":0,"duration":"1s","reason":"dial-failed","dial_attempts":1}`,
		`{"time":"2026-01-01T00:00:00Z","level":"info","msg":"connection closed","access":"tcp","service":"a/b:c","client":"10.0.0.1:1234","endpoint":"none","bytes_to_endpoint":0,"bytes_to_client":0,"duration":"1s","reason":"dial-failed","dial_attempts":1,"packets_to_client":3}`,
		`{"time":"2026-01-01T00:00:00Z","level":"info","msg":"session ended","access":"udp","service":"a/b:c","client":"10.0.0.1:1234","endpoint":"none","bytes_to_endpoint":0,"bytes_to_client":0,"duration":"1s","reason":"eaten","packets_to_endpoint":0,"packets_to_client":0}`,
	} {
		if err := schema.Validate([]byte(bad)); err == nil {
			t.Errorf("schema accepts a bad line: %s", bad)
		}
	}
}
