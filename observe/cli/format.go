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

// column of the table. A finite stream is measured whole before it prints; a followed one
// prints as rows arrive, so each column is as wide as the widest value seen so far (the header
// waits for the first rows, so it matches them).
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
		{title: "TIME"}, {title: "NODE"}, {title: "SERVICE"}, {title: flowTitle}, {title: "VERDICT"},
		{title: "PHASE"}, {title: "DURATION", right: true}, {title: "BYTES"},
	}
	if wide {
		cols = append(cols, column{title: "EP-NODE"}, column{title: "PICK"}, column{title: "DIALS", right: true},
			column{title: "CONNECT", right: true}, column{title: "1ST-BYTE", right: true}, column{title: "REASON"},
			column{title: "ERROR"})
	}
	for i := range cols {
		cols[i].width = utf8.RuneCountInString(cols[i].title)
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
	out     io.Writer
	wide    bool
	color   bool
	loc     *time.Location
	cols    []column
	header  bool     // printed
	pending [][]cell // rows added since the last flush
}

func newPrinter(out io.Writer, wide, color bool, loc *time.Location) *printer {
	return &printer{out: out, wide: wide, color: color, loc: loc, cols: tableColumns(wide)}
}

type cell struct {
	text, color string
}

// add queues f's row for the next flush.
func (p *printer) add(f *observe.Flow) { p.pending = append(p.pending, p.cells(f)) }

// flush widens the columns for the queued rows, then prints them (after the header, the first time).
func (p *printer) flush() error {
	if len(p.pending) == 0 {
		return nil
	}
	for _, r := range p.pending {
		for i, c := range r {
			if n := utf8.RuneCountInString(c.text); n > p.cols[i].width {
				p.cols[i].width = n
			}
		}
	}
	var b strings.Builder
	if !p.header {
		p.header = true
		titles := make([]cell, len(p.cols))
		for i, c := range p.cols {
			titles[i] = cell{text: c.title}
		}
		p.row(&b, titles)
	}
	for _, r := range p.pending {
		p.row(&b, r)
	}
	p.pending = p.pending[:0]
	_, err := io.WriteString(p.out, b.String())
	return err
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

// row pads every cell but the last to its column's width. Colour codes go around the text, not
// the padding, so they do not count as width.
func (p *printer) row(b *strings.Builder, cells []cell) {
	for i, c := range cells {
		col := p.cols[i]
		pad := strings.Repeat(" ", col.width-utf8.RuneCountInString(c.text))
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
