// Package cli is `kube-portal-proxy observe`: it reads one or more /debug/flows streams (the local
// proxy, one node's, or every node's merged by time) and prints each flow event as a table row or
// NDJSON, or writes a capture. It speaks HTTP only; the protocol is in observe/wire.go.
package cli

import (
	"fmt"
	"io"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// Options are the command line, parsed and checked.
type Options struct {
	Address    string
	Node       string
	AllNodes   bool
	Kubeconfig string
	Port       int
	Scheme     string
	Insecure   bool
	CAFile     string

	Follow bool
	Last   int // -1: not asked
	Since  string
	MaxRPS int

	Output string // table, wide or json
	Color  string // auto, always or never

	PCAP         string
	CaptureBytes int

	// Query is the /debug/flows query the flags ask for.
	Query url.Values
}

// filterFlag is one allow filter and its deny twin: the flag is the name the user types, key the
// query parameter, check validates one value (and may normalise it).
type filterFlag struct {
	flag, key, usage string
	short            string
	check            func(string) (string, error)
}

var filterFlags = []filterFlag{
	{"namespace", "namespace", "only flows of Services in this namespace", "n", notEmpty},
	{"service", "service", "only flows of this Service (namespace/name, or name)", "", checkService},
	{"pod", "pod", "only flows whose endpoint or client pod (namespace/name) starts with this", "", notEmpty},
	{"client", "client", "only flows from this client address (IP or CIDR)", "", checkClient},
	{"to-port", "port", "only flows to this port (the service port's or the endpoint's number, or the port's name)", "", notEmpty},
	{"protocol", "protocol", "only flows of this protocol (tcp or udp)", "", checkProtocol},
	{"verdict", "verdict", "only flows with this verdict (" + verdictList() + ")", "", checkVerdict},
	{"path", "path", "only flows of this data path (socket or kernel)", "", checkPath},
}

func verdictList() string {
	names := make([]string, flow.NumVerdicts)
	for v := range flow.NumVerdicts {
		names[v] = v.String()
	}
	return strings.Join(names, ", ")
}

// Parse reads the observe command line (without the word "observe"). --help prints the usage to
// out and returns pflag.ErrHelp.
func Parse(args []string, out io.Writer) (*Options, error) {
	fs := pflag.NewFlagSet("kube-portal-proxy observe", pflag.ContinueOnError)
	fs.SetOutput(out)
	fs.SortFlags = false
	o := &Options{}
	filters := o.addFlags(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if !fs.Changed("last") {
		o.Last = -1
	}
	if err := o.check(fs); err != nil {
		return nil, err
	}
	q, err := filters.query()
	if err != nil {
		return nil, err
	}
	o.addStreamParams(q)
	o.Query = q
	return o, nil
}

// filterValues are what the filter flags hold once parsed.
type filterValues struct {
	byFlag            map[string]*[]string // by flag name, the not- forms included
	phases, notPhases *[]string
}

// addFlags defines the flags on fs, in the order the usage lists them: those of o, and the
// filters, whose values it returns.
func (o *Options) addFlags(fs *pflag.FlagSet) *filterValues {
	fs.StringVar(&o.Address, "address", "127.0.0.1:10249", "the local proxy's flows address (its metrics address), host:port")
	fs.StringVar(&o.Node, "node", "", "watch this node's proxy: its InternalIP and --port, authenticated with the kubeconfig's credentials")
	fs.BoolVar(&o.AllNodes, "all-nodes", false, "watch every node's proxy, merged into one stream ordered by time")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "kubeconfig for --node and --all-nodes (default $KUBECONFIG or ~/.kube/config)")
	fs.IntVar(&o.Port, "port", 10249, "the proxies' flows port on the nodes (--node, --all-nodes)")
	fs.StringVar(&o.Scheme, "scheme", "http", "http or https, to reach the proxies (with http a bearer token travels in clear)")
	fs.BoolVar(&o.Insecure, "insecure-skip-tls-verify", false, "https: do not verify the proxies' certificates")
	fs.StringVar(&o.CAFile, "certificate-authority", "", "https: verify the proxies' certificates with this CA bundle (default the system's)")

	fs.BoolVarP(&o.Follow, "follow", "f", false, "keep the stream open and print new flows as they happen")
	fs.IntVar(&o.Last, "last", 0, "first print the last N matching events (default without --follow: every event the proxy keeps)")
	fs.StringVar(&o.Since, "since", "", "only events at or after this time: a duration (5m) or an RFC3339 time")
	fs.IntVar(&o.MaxRPS, "max-rps", 0, "at most this many events per second (the proxy drops the rest and says how many); 0: the proxy's limit")

	f := &filterValues{byFlag: map[string]*[]string{}}
	for _, ff := range filterFlags {
		allow, deny := new([]string), new([]string)
		fs.StringSliceVarP(allow, ff.flag, ff.short, nil, ff.usage+"; repeat or comma-separate to allow several")
		fs.StringSliceVar(deny, "not-"+ff.flag, nil, "drop flows that match, as --"+ff.flag)
		f.byFlag[ff.flag], f.byFlag["not-"+ff.flag] = allow, deny
	}
	f.phases = fs.StringSlice("phase", []string{"end"}, "events of these phases (start, held, dial, first-byte, end), or all; the default prints one line per flow, when it ends")
	f.notPhases = fs.StringSlice("not-phase", nil, "drop events of these phases")

	fs.StringVarP(&o.Output, "output", "o", "table", "table, wide (adds pick, dials, latencies, end reason, error) or json (the stream's items, one per line)")
	fs.StringVar(&o.Color, "color", "auto", "colour the verdict: auto (when stdout is a terminal), always or never")
	fs.StringVar(&o.PCAP, "pcap", "", "also capture the flows' payload (the proxy must allow capture) into this pcapng file")
	fs.IntVar(&o.CaptureBytes, "capture-bytes", 0, "with --pcap: capture at most this many bytes per flow (default the proxy's, 64 KiB)")
	return f
}

// query checks the filters' values and turns them into /debug/flows query parameters.
func (f *filterValues) query() (url.Values, error) {
	q := url.Values{}
	for _, ff := range filterFlags {
		for _, prefix := range []string{"", "not-"} {
			for _, v := range *f.byFlag[prefix+ff.flag] {
				v, err := ff.check(strings.TrimSpace(v))
				if err != nil {
					return nil, fmt.Errorf("--%s%s: %w", prefix, ff.flag, err)
				}
				q.Add(prefix+ff.key, v)
			}
		}
	}
	if err := addPhases(q, "phase", *f.phases, true); err != nil {
		return nil, err
	}
	if err := addPhases(q, "not-phase", *f.notPhases, false); err != nil {
		return nil, err
	}
	return q, nil
}

// check validates the flags that are not filters.
func (o *Options) check(fs *pflag.FlagSet) error {
	switch {
	case o.Node != "" && o.AllNodes:
		return fmt.Errorf("--node and --all-nodes: choose one")
	case fs.Changed("address") && (o.Node != "" || o.AllNodes):
		return fmt.Errorf("--address and --node/--all-nodes: choose one")
	case o.Port < 1 || o.Port > 65535:
		return fmt.Errorf("--port: %d is not a port", o.Port)
	case o.Scheme != "http" && o.Scheme != "https":
		return fmt.Errorf("--scheme: %q: want http or https", o.Scheme)
	case o.Insecure && o.CAFile != "":
		return fmt.Errorf("--insecure-skip-tls-verify and --certificate-authority: choose one")
	case fs.Changed("last") && o.Last < 0:
		return fmt.Errorf("--last: %d: want >= 0", o.Last)
	case o.MaxRPS < 0:
		return fmt.Errorf("--max-rps: %d: want >= 0", o.MaxRPS)
	case o.Output != "table" && o.Output != "wide" && o.Output != "json":
		return fmt.Errorf("--output: %q: want table, wide or json", o.Output)
	case o.Color != "auto" && o.Color != "always" && o.Color != "never":
		return fmt.Errorf("--color: %q: want auto, always or never", o.Color)
	case o.CaptureBytes < 0:
		return fmt.Errorf("--capture-bytes: %d: want >= 0", o.CaptureBytes)
	case o.CaptureBytes > 0 && o.PCAP == "":
		return fmt.Errorf("--capture-bytes needs --pcap")
	}
	if err := checkAddress(o.Address); err != nil {
		return fmt.Errorf("--address: %w", err)
	}
	if o.Since != "" {
		if err := checkSince(o.Since); err != nil {
			return fmt.Errorf("--since: %w", err)
		}
	}
	return nil
}

// addStreamParams adds the parameters that shape the stream rather than filter it.
func (o *Options) addStreamParams(q url.Values) {
	if o.Follow {
		q.Set("follow", "1")
	}
	if o.Last >= 0 {
		q.Set("last", strconv.Itoa(o.Last))
	}
	if o.Since != "" {
		q.Set("since", o.Since)
	}
	if o.MaxRPS > 0 {
		q.Set("rate", strconv.Itoa(o.MaxRPS))
	}
	if o.PCAP != "" {
		q.Set("capture", "1")
		if o.CaptureBytes > 0 {
			q.Set("capture_bytes", strconv.Itoa(o.CaptureBytes))
		}
	}
}

func addPhases(q url.Values, key string, values []string, allowAll bool) error {
	for _, v := range values {
		v = strings.TrimSpace(v)
		if allowAll && v == "all" {
			if len(values) > 1 {
				return fmt.Errorf("--%s: all cannot be combined with other phases", key)
			}
			return nil
		}
		if _, err := flow.ParsePhase(v); err != nil {
			return fmt.Errorf("--%s: %w", key, err)
		}
		q.Add(key, v)
	}
	return nil
}

func checkSince(s string) error {
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return fmt.Errorf("%q: a duration must not be negative", s)
		}
		return nil
	}
	if _, err := time.Parse(time.RFC3339, s); err != nil {
		return fmt.Errorf("%q: want a duration (5m) or an RFC3339 time (2006-01-02T15:04:05Z)", s)
	}
	return nil
}

func notEmpty(s string) (string, error) {
	if s == "" {
		return "", fmt.Errorf("empty value")
	}
	return s, nil
}

func checkService(s string) (string, error) {
	ns, name, found := strings.Cut(s, "/")
	if s == "" || (found && (ns == "" || name == "" || strings.Contains(name, "/"))) {
		return "", fmt.Errorf("%q: want namespace/name or name", s)
	}
	return s, nil
}

func checkClient(s string) (string, error) {
	if _, err := netip.ParsePrefix(s); err == nil {
		return s, nil
	}
	if _, err := netip.ParseAddr(s); err != nil {
		return "", fmt.Errorf("%q: want an IP address or a CIDR", s)
	}
	return s, nil
}

func checkProtocol(s string) (string, error) {
	p := strings.ToLower(s)
	if p != "tcp" && p != "udp" {
		return "", fmt.Errorf("%q: want tcp or udp", s)
	}
	return p, nil
}

func checkVerdict(s string) (string, error) {
	if _, err := flow.ParseVerdict(s); err != nil {
		return "", err
	}
	return s, nil
}

func checkPath(s string) (string, error) {
	if s != "socket" && s != "kernel" {
		return "", fmt.Errorf("%q: want socket or kernel", s)
	}
	return s, nil
}
