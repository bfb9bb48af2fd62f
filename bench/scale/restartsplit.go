package main

// restartsplit.go: where a SIGKILL restart's time goes, as the bench sees it: the kill, the old
// process reaped, the new one started, its "serving" log line read, and the client's attempts
// that failed or took long; with the kernel's TCP counters of the client's and the node's
// namespaces across the restart, and (-pcap) a packet capture of each namespace.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/netns"
	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testbed"
)

// servingMessage is the daemon's info line once the reopened proxy sockets serve
// (daemon/startup.go).
const servingMessage = "Proxy sockets open: serving"

// logWatch passes a process's log on to w and records when the first line holding msg was
// written (as exec.Cmd's copying goroutine hands it over: read time, not the daemon's).
type logWatch struct {
	w   io.Writer
	msg []byte

	mu      sync.Mutex
	partial []byte // the current line's start, while it holds no newline
	at      time.Time
}

func newLogWatch(w io.Writer, msg string) *logWatch { return &logWatch{w: w, msg: []byte(msg)} }

func (l *logWatch) Write(p []byte) (int, error) {
	now := time.Now()
	l.mu.Lock()
	if l.at.IsZero() {
		l.partial = append(l.partial, p...)
		if bytes.Contains(l.partial, l.msg) {
			l.at, l.partial = now, nil
		} else if i := bytes.LastIndexByte(l.partial, '\n'); i >= 0 {
			l.partial = append(l.partial[:0], l.partial[i+1:]...)
		}
	}
	l.mu.Unlock()
	return l.w.Write(p)
}

// seen is when the line came, zero if not (yet).
func (l *logWatch) seen() time.Time {
	if l == nil {
		return time.Time{}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.at
}

// split is one SIGKILL restart's timeline.
type split struct {
	killed, reaped, started time.Time
	serving                 *logWatch
	// settled, when not nil, yields once the restarted process serves everything (its first
	// sync done); the client keeps connecting until then.
	settled   <-chan error
	settledAt time.Time
	slow      []attempt // attempts that failed or took over slowAttempt
}

// attempt is one client connection of the restart window.
type attempt struct {
	start time.Time
	took  time.Duration
	err   error
}

// slowAttempt is the attempt that counts as suspect: one SYN retransmitted (the first RTO is 1 s)
// or a connection held that long.
const slowAttempt = 900 * time.Millisecond

func (s split) String() string {
	var b strings.Builder
	since := func(t time.Time) string {
		if t.IsZero() {
			return "?"
		}
		return t.Sub(s.killed).Round(time.Millisecond).String()
	}
	serving := s.serving.seen()
	fmt.Fprintf(&b, "  split: kill -> reaped %v; reaped -> started %v; started -> serving line %s (kill -> serving %s)\n",
		s.reaped.Sub(s.killed).Round(time.Millisecond), s.started.Sub(s.reaped).Round(time.Millisecond),
		func() string {
			if serving.IsZero() {
				return "not seen (file mode logs it with -log-level info)"
			}
			return serving.Sub(s.started).Round(time.Millisecond).String()
		}(), since(serving))
	if !s.settledAt.IsZero() {
		fmt.Fprintf(&b, "  settled (first sync done, snapshot written) at kill+%s\n", since(s.settledAt))
	}
	// Every attempt over slowAttempt (the suspects), and the first few quick failures.
	quick := 0
	for _, a := range s.slow {
		if a.took <= slowAttempt {
			if quick++; quick > 6 {
				continue
			}
		}
		what := "answered"
		if a.err != nil {
			what = a.err.Error()
		}
		fmt.Fprintf(&b, "  attempt at kill+%v took %v: %s\n", a.start.Sub(s.killed).Round(time.Millisecond), a.took.Round(time.Millisecond), what)
	}
	if quick > 6 {
		fmt.Fprintf(&b, "  ... %d more quick failures\n", quick-6)
	}
	return b.String()
}

// tcpCounters are a namespace's /proc/net/snmp and /proc/net/netstat, "Group:Name" -> value.
type tcpCounters map[string]int64

// readTCPCounters reads ns's counters from a thread in it.
func readTCPCounters(ns *netns.NS) (tcpCounters, error) {
	c := tcpCounters{}
	err := ns.Do(func() error {
		for _, f := range []string{"snmp", "netstat"} {
			data, err := os.ReadFile("/proc/thread-self/net/" + f)
			if err != nil {
				return err
			}
			if err := c.parse(data); err != nil {
				return fmt.Errorf("/proc/net/%s: %w", f, err)
			}
		}
		return nil
	})
	return c, err
}

// parse reads the pairs of lines "Group: names..." and "Group: values...".
func (c tcpCounters) parse(data []byte) error {
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		names, values := strings.Fields(lines[i]), strings.Fields(lines[i+1])
		if len(names) != len(values) || len(names) == 0 || names[0] != values[0] {
			return fmt.Errorf("line %d: names and values do not pair", i+1)
		}
		group := strings.TrimSuffix(names[0], ":")
		for j := 1; j < len(names); j++ {
			v, err := strconv.ParseInt(values[j], 10, 64)
			if err != nil {
				continue // Tcp's MaxConn is -1, fine; anything else unparsable is left out
			}
			c[group+":"+names[j]] = v
		}
	}
	return nil
}

// tcpCounterWatched says which counters a restart's delta prints: TCP's and TCP's extended,
// those that tell a SYN dropped, retransmitted or reset, or a listener's queue overflowing.
func tcpCounterWatched(name string) bool {
	if !strings.HasPrefix(name, "Tcp:") && !strings.HasPrefix(name, "TcpExt:") {
		return false
	}
	for _, s := range []string{"Retrans", "Drop", "Overflow", "Abort", "Reset", "Rst", "RST", "Fail", "Err", "ActiveOpens", "PassiveOpens", "ReqQ", "Timeout"} {
		if strings.Contains(name, s) {
			return true
		}
	}
	return false
}

// delta prints the watched counters that moved from before to c.
func (c tcpCounters) delta(before tcpCounters) string {
	var out []string
	for k, v := range c {
		if d := v - before[k]; d != 0 && tcpCounterWatched(k) {
			out = append(out, fmt.Sprintf("%s=%d", strings.TrimPrefix(k, "TcpExt:"), d))
		}
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

// pcapDir is -pcap: where each SIGKILL run's captures go (empty: none).
var pcapDir string

// capture runs tcpdump in ns (port 80 and 8080: the client's connections to the service and the
// proxy's to the pods; ICMP and ARP: a SYN forwarded untranslated ends in a failed neighbour
// lookup and a host-unreachable) into file until stop.
func capture(ctx context.Context, ns *netns.NS, file string) (stop func() error, err error) {
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns.Name, "tcpdump", "-i", "any", "-n", "-U", "-s", "128",
		"-w", file, "tcp port 80 or tcp port 8080 or icmp or arp")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("tcpdump in %s: %w", ns.Name, err)
	}
	listening := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		once := false
		for sc.Scan() {
			if !once && strings.Contains(sc.Text(), "listening on") {
				close(listening)
				once = true
			}
		}
		if !once {
			close(listening)
		}
	}()
	select {
	case <-listening:
	case <-time.After(10 * time.Second):
	}
	return func() error {
		_ = cmd.Process.Signal(syscall.SIGINT)
		err := cmd.Wait()
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return nil // killed by its signal, or a non-zero exit after flushing: the file is what it is
		}
		return err
	}, nil
}

// restartEvidence is what one SIGKILL run records beside the window: counters and captures.
type restartEvidence struct {
	client, node tcpCounters
	stops        []func() error
}

// startEvidence reads the counters and starts the captures (with -pcap) of run i.
func startEvidence(ctx context.Context, bed *testbed.Bed, i int) (*restartEvidence, error) {
	e := &restartEvidence{}
	var err error
	if e.client, err = readTCPCounters(bed.Client); err != nil {
		return nil, err
	}
	if e.node, err = readTCPCounters(bed.Node); err != nil {
		return nil, err
	}
	if pcapDir == "" {
		return e, nil
	}
	for _, ns := range []*netns.NS{bed.Client, bed.Node} {
		stop, err := capture(ctx, ns, filepath.Join(pcapDir, fmt.Sprintf("run%d-%s.pcap", i, ns.Name)))
		if err != nil {
			_ = e.finish(bed)
			return nil, err
		}
		e.stops = append(e.stops, stop)
	}
	// The node's TCP conntrack entries as they are made, all of them (a new entry's reply tuple
	// tells whether the portal rule translated it; an entry made by another flow can take a
	// client's SYN as its reply), and every change to its ruleset, each line stamped when read.
	for _, rec := range []struct {
		name string
		args []string
	}{
		{"conntrack", []string{"conntrack", "-E", "-e", "NEW,DESTROY", "-p", "tcp"}},
		{"nft-monitor", []string{"nft", "monitor"}},
		// The entries of the services' port every half second but the closed ones: a client's
		// SYN on a port whose old entry is still open is INVALID to conntrack, so it is
		// neither translated nor recorded as a new entry.
		{"conntrack-open", []string{"sh", "-c", "while :; do conntrack -L -p tcp --dport 80 2>/dev/null | grep -v -e TIME_WAIT -e ' CLOSE '; echo ---; sleep 0.5; done"}},
	} {
		stop, err := recordLines(ctx, bed.Node, filepath.Join(pcapDir, fmt.Sprintf("run%d-%s.txt", i, rec.name)), rec.args...)
		if err != nil {
			_ = e.finish(bed)
			return nil, err
		}
		e.stops = append(e.stops, stop)
	}
	return e, nil
}

// recordLines runs args in ns until stop, writing each line of its output to file after the
// wall-clock time it was read.
func recordLines(ctx context.Context, ns *netns.NS, file string, args ...string) (stop func() error, err error) {
	f, err := os.Create(file)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns.Name}, args...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		f.Close()
		return nil, err
	}
	// Its stderr (conntrack's closing count) would interleave with the stamped lines.
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s in %s: %w", args[0], ns.Name, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		w := bufio.NewWriter(f)
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			fmt.Fprintf(w, "%s %s\n", time.Now().UTC().Format("15:04:05.000000"), sc.Text())
		}
		_ = w.Flush()
	}()
	return func() error {
		_ = cmd.Process.Signal(syscall.SIGINT)
		<-done
		_ = cmd.Wait()
		return f.Close()
	}, nil
}

// finish stops the captures and prints the counters' deltas.
func (e *restartEvidence) finish(bed *testbed.Bed) error {
	var errs []error
	for _, stop := range e.stops {
		errs = append(errs, stop())
	}
	e.stops = nil
	if e.client == nil {
		return errors.Join(errs...)
	}
	client, err := readTCPCounters(bed.Client)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	node, err := readTCPCounters(bed.Node)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	fmt.Printf("  client ns counters: %s\n  node ns counters: %s\n", client.delta(e.client), node.delta(e.node))
	return errors.Join(errs...)
}
