package metrics

import (
	"bufio"
	"compress/gzip"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/common/expfmt"
)

// Handler serves /metrics: reg's series, then the traffic series of src. In the text format (what
// Prometheus asks for unless told to scrape protobuf) the traffic series are written straight to
// the response from the ports' counters: through a registry, every series became a const metric,
// a label-pair slice and a protobuf message first, about 39 MB of garbage per scrape at 10,000
// TCP ports. Any other format goes through promhttp with the traffic collector beside reg.
// reg must not hold a traffic collector of its own.
func Handler(reg prometheus.Gatherer, src TrafficSource) http.Handler {
	traffic := prometheus.NewRegistry()
	traffic.MustRegister(NewTrafficCollector(src))
	return &handler{reg: reg, src: src, other: promhttp.HandlerFor(prometheus.Gatherers{reg, traffic}, promhttp.HandlerOpts{})}
}

type handler struct {
	reg   prometheus.Gatherer
	src   TrafficSource
	other http.Handler

	// mu guards ports, the snapshot reused by every scrape (one at a time: a scrape reads each
	// port once, then writes each family over all of them).
	mu    sync.Mutex
	ports portPages

	// own is the writers of one scrape at a time, kept from scrape to scrape; a scrape that
	// finds them in use takes others from the pools. A pooled gzip writer (over 1 MB) was gone
	// by the next scrape: a pool lets go of what two garbage collections find unused, and
	// Prometheus scrapes every 15-60 s.
	own struct {
		sync.Mutex
		gz *gzip.Writer
		bw *bufio.Writer
	}
}

// pageLen is how many ports a page of the snapshot holds (about 58 KiB).
const pageLen = 128

// portPages is the scrape's snapshot of the ports, in pages that are kept from scrape to scrape.
// A slice grown by append copied itself over and over: at 10,000 ports (464 bytes each) the
// first scrape allocated 23 MB for a 4.6 MB snapshot; pages are allocated once each, never copied.
type portPages struct {
	pages [][]PortTraffic
	n     int
	// labels holds each port's service_port value, escaped, one after another; ends[i] is where
	// port i's ends. Every family writes it again: escaped once a scrape instead of once a
	// series (100,000 at 10,000 ports), it is a copy.
	labels []byte
	ends   []int32
}

func (p *portPages) reset() { p.n, p.labels, p.ends = 0, p.labels[:0], p.ends[:0] }

func (p *portPages) add(t PortTraffic) {
	i := p.n / pageLen
	if i == len(p.pages) {
		p.pages = append(p.pages, make([]PortTraffic, pageLen))
	}
	p.pages[i][p.n%pageLen] = t
	p.n++
	p.labels = appendEscaped(p.labels, t.Name.Namespace)
	p.labels = append(p.labels, '/')
	p.labels = appendEscaped(p.labels, t.Name.Name)
	if t.Name.Port != "" {
		p.labels = append(p.labels, ':')
		p.labels = appendEscaped(p.labels, t.Name.Port)
	}
	p.ends = append(p.ends, int32(len(p.labels)))
}

// at is the i-th port added since reset.
func (p *portPages) at(i int) *PortTraffic { return &p.pages[i/pageLen][i%pageLen] }

// label is the i-th port's service_port value, escaped.
func (p *portPages) label(i int) []byte {
	start := int32(0)
	if i > 0 {
		start = p.ends[i-1]
	}
	return p.labels[start:p.ends[i]]
}

// trim lets the pages beyond what the last scrape used go, when they are many (the ports were
// many more before): a few spare pages are kept for growth.
func (p *portPages) trim() {
	used := (p.n + pageLen - 1) / pageLen
	if len(p.pages) > 2*used+4 {
		clear(p.pages[used:])
		p.pages = slices.Clip(p.pages[:used])
		p.labels, p.ends = slices.Clone(p.labels), slices.Clone(p.ends)
	}
}

var (
	bufPool = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 32<<10) }}
	// gzipPool's writers compress at gzip's best speed: at 10,000 ports (100,000 series, about
	// 10 MB of text) the default level's deflate was over a third of a scrape's CPU, and a
	// scrape took 140-170 ms on a loaded node; the fastest level makes the body about a third
	// larger, on a link that carries it in a millisecond or two.
	gzipPool = sync.Pool{New: func() any {
		gz, _ := gzip.NewWriterLevel(nil, gzip.BestSpeed) // a valid level: no error
		return gz
	}}
)

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	format := expfmt.Negotiate(r.Header)
	if format.FormatType() != expfmt.TypeTextPlain {
		h.other.ServeHTTP(w, r)
		return
	}
	mfs, err := h.reg.Gather()
	if err != nil {
		// As promhttp's default (HTTPErrorOnError): nothing rather than part of the series.
		http.Error(w, "An error has occurred while serving metrics:\n\n"+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", string(format))
	gz, bw, own := h.writers()
	defer h.putWriters(gz, bw, own)
	var out io.Writer = w
	if acceptsGzip(r.Header.Get("Accept-Encoding")) {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Del("Content-Length")
		gz.Reset(w)
		defer gz.Close() // before putWriters (deferred earlier, run later)
		out = gz
	}
	bw.Reset(out)
	enc := expfmt.NewEncoder(bw, format)
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return // the client went away
		}
	}
	h.writeTraffic(bw)
	bw.Flush()
}

// writers returns the handler's own writers (own true; putWriters unlocks them), or pooled ones
// while another scrape has them.
func (h *handler) writers() (gz *gzip.Writer, bw *bufio.Writer, own bool) {
	if !h.own.TryLock() {
		return gzipPool.Get().(*gzip.Writer), bufPool.Get().(*bufio.Writer), false
	}
	if h.own.gz == nil {
		h.own.gz, h.own.bw = gzipPool.New().(*gzip.Writer), bufPool.New().(*bufio.Writer)
	}
	return h.own.gz, h.own.bw, true
}

// putWriters lets go of the response in the writers and gives them back.
func (h *handler) putWriters(gz *gzip.Writer, bw *bufio.Writer, own bool) {
	gz.Reset(nil)
	bw.Reset(nil)
	if own {
		h.own.Unlock()
		return
	}
	gzipPool.Put(gz)
	bufPool.Put(bw)
}

// acceptsGzip reports whether an Accept-Encoding header lists gzip (without q=0).
func acceptsGzip(header string) bool {
	for part := range strings.SplitSeq(header, ",") {
		enc, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.TrimSpace(enc) == "gzip" {
			return strings.ReplaceAll(params, " ", "") != "q=0"
		}
	}
	return false
}

// writeTraffic writes the traffic series as text, family by family, as a registry would (the same
// names, help, types and label order; ports in the source's order).
func (h *handler) writeTraffic(bw *bufio.Writer) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ports.reset()
	for t := range h.src.Traffic() {
		h.ports.add(t)
	}
	defer h.ports.trim()
	// One closure for the whole scrape: a closure per port and family would escape to the heap
	// (samples is called through a func value), 200,000 of them at 10,000 ports.
	var (
		line   []byte
		f      *family
		t      *PortTraffic
		label  []byte
		header bool
	)
	add := func(v float64, l1, l2 string) {
		line = line[:0]
		if !header {
			header = true
			line = appendHeader(line, f)
		}
		line = append(line, metricPrefix...)
		line = append(line, f.name...)
		line = append(line, '{')
		if len(f.labels) > 0 {
			line = append(appendLabel(line, f.labels[0], l1), ',')
		}
		if len(f.labels) > 1 {
			line = append(appendLabel(line, f.labels[1], l2), ',')
		}
		line = append(line, `service_port="`...)
		line = append(line, label...)
		line = append(line, `"} `...)
		line = appendFloat(line, v)
		line = append(line, '\n')
		bw.Write(line)
	}
	for i := range families {
		f, header = &families[i], false
		for j := range h.ports.n {
			t, label = h.ports.at(j), h.ports.label(j)
			f.samples(t, add)
		}
	}
}

func appendHeader(b []byte, f *family) []byte {
	b = append(b, "# HELP "+metricPrefix...)
	b = append(b, f.name...)
	b = append(b, ' ')
	for _, c := range []byte(f.help) {
		switch c {
		case '\\':
			b = append(b, `\\`...)
		case '\n':
			b = append(b, `\n`...)
		default:
			b = append(b, c)
		}
	}
	b = append(b, "\n# TYPE "+metricPrefix...)
	b = append(b, f.name...)
	if f.gauge {
		return append(b, " gauge\n"...)
	}
	return append(b, " counter\n"...)
}

func appendLabel(b []byte, name, value string) []byte {
	b = append(b, name...)
	b = append(b, `="`...)
	b = appendEscaped(b, value)
	return append(b, '"')
}

// appendEscaped escapes a label value as the text format wants: backslash, quote and newline.
// Nearly every value has none of them, and is copied whole.
func appendEscaped(b []byte, s string) []byte {
	if !strings.ContainsAny(s, "\\\"\n") {
		return append(b, s...)
	}
	for i := range len(s) {
		switch c := s[i]; c {
		case '\\':
			b = append(b, `\\`...)
		case '"':
			b = append(b, `\"`...)
		case '\n':
			b = append(b, `\n`...)
		default:
			b = append(b, c)
		}
	}
	return b
}

// appendFloat formats a sample value as expfmt does.
func appendFloat(b []byte, v float64) []byte {
	return strconv.AppendFloat(b, v, 'g', -1, 64)
}
