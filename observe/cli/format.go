package cli

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// column of the table. Rows are printed as they arrive, so the table cannot be measured first:
// each column starts at a width that fits typical values and widens (for the rows after) when a
// value is longer.
type column struct {
	title string
	width int
	right bool
}

func tableColumns(wide bool) []column {
	flowTitle := "CLIENT -> ENDPOINT (POD)"
	if wide {
		flowTitle = "CLIENT (POD) -> ENDPOINT (POD)"
	}
	cols := []column{
		{title: "TIME", width: 12}, {title: "NODE", width: 6}, {title: "SERVICE", width: 11},
		{title: flowTitle, width: 52}, {title: "VERDICT", width: 9}, {title: "PHASE", width: 5},
		{title: "DURATION", width: 8, right: true}, {title: "BYTES", width: 9},
	}
	if wide {
		cols = append(cols, column{title: "EP-NODE", width: 7}, column{title: "PICK", width: 11},
			column{title: "DIALS", width: 5, right: true}, column{title: "CONNECT", width: 7, right: true},
			column{title: "1ST-BYTE", width: 8, right: true}, column{title: "REASON", width: 14},
			column{title: "ERROR"})
	}
	return cols
}

// The ANSI colours of verdicts.
const (
	green  = "\x1b[32m"
	red    = "\x1b[31m"
	yellow = "\x1b[33m"
	cyan   = "\x1b[36m"
	reset  = "\x1b[0m"
)

// verdictColor: green when the flow went as asked, red when the client was refused or a side
// failed, yellow when the proxy cut or held it by policy or timer.
func verdictColor(v string) string {
	switch v {
	case "forwarded":
		return green
	case "refused", "dial-failed", "reset", "source-denied", "unreachable", "failed":
		return red
	case "held", "timeout", "drained", "ejected", "evicted", "closed":
		return yellow
	case "kernel":
		return cyan
	}
	return ""
}

// printer writes flows as table rows.
type printer struct {
	out    io.Writer
	wide   bool
	color  bool
	loc    *time.Location
	cols   []column
	header bool // printed
}

func newPrinter(out io.Writer, wide, color bool, loc *time.Location) *printer {
	return &printer{out: out, wide: wide, color: color, loc: loc, cols: tableColumns(wide)}
}

type cell struct {
	text, color string
}

func (p *printer) flow(f *observe.Flow) error {
	if !p.header {
		p.header = true
		titles := make([]cell, len(p.cols))
		for i, c := range p.cols {
			titles[i] = cell{text: c.title}
		}
		if err := p.row(titles); err != nil {
			return err
		}
	}
	return p.row(p.cells(f))
}

func (p *printer) cells(f *observe.Flow) []cell {
	cs := []cell{
		{text: f.Time.In(p.loc).Format("15:04:05.000")},
		{text: orDash(f.Node)},
		{text: serviceName(f)},
		{text: flowText(f, p.wide)},
		{text: f.Verdict, color: verdictColor(f.Verdict)},
		{text: f.Phase},
		{text: micros(f.DurationMicros)},
		{text: bytesText(f.BytesToEndpoint) + "/" + bytesText(f.BytesToClient)},
	}
	if !p.wide {
		return cs
	}
	dials := "-"
	if f.DialAttempts > 0 {
		dials = strconv.Itoa(f.DialAttempts)
	}
	return append(cs, cell{text: orDash(f.EndpointNode)}, cell{text: pickText(f.Pick)}, cell{text: dials},
		cell{text: micros(f.ConnectMicros)}, cell{text: micros(f.FirstByteMicros)},
		cell{text: orDash(f.EndReason)}, cell{text: orDash(f.Error)})
}

// row pads every cell but the last to its column's width, widening the column if needed.
func (p *printer) row(cells []cell) error {
	var b strings.Builder
	for i, c := range cells {
		col := &p.cols[i]
		n := utf8.RuneCountInString(c.text)
		if n > col.width {
			col.width = n
		}
		pad := strings.Repeat(" ", col.width-n)
		text := c.text
		if p.color && c.color != "" {
			text = c.color + text + reset
		}
		last := i == len(cells)-1
		switch {
		case col.right:
			b.WriteString(pad + text)
		case last:
			b.WriteString(text)
		default:
			b.WriteString(text + pad)
		}
		if !last {
			b.WriteString("  ")
		}
	}
	b.WriteString("\n")
	_, err := io.WriteString(p.out, b.String())
	return err
}

func serviceName(f *observe.Flow) string {
	s := f.Namespace + "/" + f.Service
	if f.Port != "" {
		s += ":" + f.Port
	}
	return s
}

// flowText is "client -> endpoint (pod)": the pod without its namespace when it is the
// Service's (an endpoint's always is), and "-" for a flow refused before any endpoint.
func flowText(f *observe.Flow, wide bool) string {
	client := orDash(f.Client)
	if wide && f.ClientPod != "" {
		client += " (" + shortPod(f.ClientPod, f.Namespace) + ")"
	}
	ep := orDash(f.Endpoint)
	if f.EndpointPod != "" {
		ep += " (" + shortPod(f.EndpointPod, f.Namespace) + ")"
	}
	return client + " -> " + ep
}

func shortPod(pod, ns string) string {
	if name, ok := strings.CutPrefix(pod, ns+"/"); ok {
		return name
	}
	return pod
}

func pickText(p *observe.Pick) string {
	if p == nil {
		return "-"
	}
	return strings.Join(append([]string{p.Algorithm}, p.Why...), "+")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// micros prints a duration with three significant digits at most: 850µs, 1.2ms, 12.3ms, 123ms,
// 4.5s, 1m5s. 0 prints "-": the wire omits what was not measured.
func micros(us int64) string {
	d := time.Duration(us) * time.Microsecond
	switch {
	case us <= 0:
		return "-"
	case d < time.Millisecond:
		return strconv.FormatInt(us, 10) + "µs"
	case d < time.Second:
		return significant(float64(us)/1e3) + "ms"
	case d < time.Minute:
		return significant(float64(us)/1e6) + "s"
	}
	return d.Round(time.Second).String()
}

// significant prints v with one decimal under 100 and none above, trimming ".0".
func significant(v float64) string {
	prec := 1
	if v >= 100 {
		prec = 0
	}
	return strings.TrimSuffix(strconv.FormatFloat(v, 'f', prec, 64), ".0")
}

// bytesText prints a byte count in SI units: 78B, 1.2kB, 34MB.
func bytesText(n uint64) string {
	const units = "kMGTPE"
	if n < 1000 {
		return strconv.FormatUint(n, 10) + "B"
	}
	v := float64(n)
	i := -1
	for v >= 1000 && i < len(units)-1 {
		v /= 1000
		i++
	}
	prec := 1
	if v >= 10 {
		prec = 0
	}
	return strings.TrimSuffix(strconv.FormatFloat(v, 'f', prec, 64), ".0") + units[i:i+1] + "B"
}

// lostText is the stderr line of a Lost item; node names the stream when the item does not.
func lostText(l *observe.Lost, node string) string {
	if l.Node != "" {
		node = l.Node
	}
	where := ""
	if node != "" {
		where = " on " + node
	}
	why := l.Reason
	switch l.Reason {
	case observe.LostSlow:
		why = "slow observer (the proxy's ring overtook this stream)"
	case observe.LostRate:
		why = "rate cap (--max-rps or the proxy's limit)"
	}
	return fmt.Sprintf("lost %d events%s: %s", l.Count, where, why)
}
