package observe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"golang.org/x/time/rate"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// The content types of the stream.
const (
	ContentTypeNDJSON = "application/x-ndjson"
	ContentTypeSSE    = "text/event-stream"
)

// batchMax bounds the events read between two flushes, so a busy ring does not starve the
// client of output nor the observer of its context's end.
const batchMax = 256

// defaultWriteStall is how long a batch may take to write before the observer is ended: a
// stalled client holds one of MaxObservers.
const defaultWriteStall = time.Minute

// defaultCoalesce is how long a woken observer lets events gather before it reads them: short
// for a person watching, and it bounds the wake-ups writers pay for to 100 a second per observer.
const defaultCoalesce = 10 * time.Millisecond

// request is a parsed /debug/flows query.
type request struct {
	filter      *Filter
	follow      bool
	last        int // -1: not given
	since       time.Time
	rate        int // 0: no cap
	capture     bool
	captureFlow int
	sse         bool
}

// The query parameters that are not filters.
const (
	paramFollow       = "follow"
	paramLast         = "last"
	paramSince        = "since"
	paramRate         = "rate"
	paramCapture      = "capture"
	paramCaptureBytes = "capture_bytes"
	paramFormat       = "format"
)

// parseRequest reads the query of a /debug/flows request; an error names the bad parameter.
func (h *Hub) parseRequest(r *http.Request) (*request, error) {
	q := r.URL.Query()
	filters, err := filterParams(q)
	if err != nil {
		return nil, err
	}
	req := &request{last: -1, captureFlow: h.cfg.CaptureFlowBytes}
	if req.filter, err = ParseFilter(filters); err != nil {
		return nil, err
	}
	if req.follow, err = boolParam(q, paramFollow); err != nil {
		return nil, err
	}
	if n, ok, err := countParam(q, paramLast, 0, "a count of events (0 or more)"); err != nil {
		return nil, err
	} else if ok {
		req.last = n
	}
	if req.since, err = h.sinceParam(q); err != nil {
		return nil, err
	}
	if req.rate, _, err = countParam(q, paramRate, 1, "events per second (1 or more)"); err != nil {
		return nil, err
	}
	if max := h.cfg.MaxRate; max > 0 && (req.rate == 0 || req.rate > max) {
		req.rate = max
	}
	if req.capture, err = boolParam(q, paramCapture); err != nil {
		return nil, err
	}
	if n, ok, err := countParam(q, paramCaptureBytes, 1, "bytes per flow (1 or more)"); err != nil {
		return nil, err
	} else if ok {
		req.captureFlow = min(n, h.cfg.CaptureFlowBytes)
	}
	if req.sse, err = formatParam(q.Get(paramFormat), r.Header.Values("Accept")); err != nil {
		return nil, err
	}
	return req, nil
}

// filterParams returns the filter parameters of q, after checking that none of the others is
// given more than once.
func filterParams(q url.Values) (url.Values, error) {
	filters := url.Values{}
	for k, vs := range q {
		switch k {
		case paramFollow, paramLast, paramSince, paramRate, paramCapture, paramCaptureBytes, paramFormat:
			if len(vs) != 1 {
				return nil, fmt.Errorf("parameter %s: given %d times, want once", k, len(vs))
			}
		default:
			filters[k] = vs
		}
	}
	return filters, nil
}

// boolParam reads parameter name of q, false when not given.
func boolParam(q url.Values, name string) (bool, error) {
	s := q.Get(name)
	if s == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(s)
	if err != nil {
		return false, fmt.Errorf("parameter %s=%q: want 1 or 0", name, s)
	}
	return b, nil
}

// countParam reads parameter name of q, a whole number of at least least (want says what it
// counts); ok is false when it is not given.
func countParam(q url.Values, name string, least int, want string) (n int, ok bool, err error) {
	s := q.Get(name)
	if s == "" {
		return 0, false, nil
	}
	if n, err = strconv.Atoi(s); err != nil || n < least {
		return 0, false, fmt.Errorf("parameter %s=%q: want %s", name, s, want)
	}
	return n, true, nil
}

// sinceParam reads the since parameter: a time, or a duration before now.
func (h *Hub) sinceParam(q url.Values) (time.Time, error) {
	s := q.Get(paramSince)
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return time.Time{}, fmt.Errorf("parameter %s=%q: want an RFC 3339 time (2006-01-02T15:04:05Z) or a duration (5m)", paramSince, s)
	}
	return h.cfg.Clock().Add(-d), nil
}

// formatParam reports whether the stream is server-sent events: format=sse, or no format and an
// Accept header that asks for them.
func formatParam(format string, accept []string) (sse bool, err error) {
	switch format {
	case "":
		return acceptsSSE(accept), nil
	case "sse":
		return true, nil
	case "ndjson", "json":
		return false, nil
	}
	return false, fmt.Errorf("parameter %s=%q: want ndjson or sse", paramFormat, format)
}

// acceptsSSE reports whether an Accept header asks for server-sent events.
func acceptsSSE(accept []string) bool {
	for _, a := range accept {
		for part := range strings.SplitSeq(a, ",") {
			mt, _, _ := strings.Cut(part, ";")
			if strings.EqualFold(strings.TrimSpace(mt), ContentTypeSSE) {
				return true
			}
		}
	}
	return false
}

// Handler serves GET /debug/flows: the ring's events that pass the request's filters (all, the
// last=N or those since=), then with follow=1 each new one as it is recorded, as NDJSON or
// server-sent events. r (nil: none) names pods. The request's goroutine is the observer: it
// ends when the request's context does (or, without follow, when the ring's events are sent).
func (h *Hub) Handler(r Resolver) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodGet && req.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "flows: method "+req.Method+" not allowed: use GET", http.StatusMethodNotAllowed)
			return
		}
		q, err := h.parseRequest(req)
		if err != nil {
			http.Error(w, "flows: "+err.Error(), http.StatusBadRequest)
			return
		}
		if q.capture && !h.cfg.Capture {
			http.Error(w, "flows: capture=1 refused: payload capture is disabled on this proxy (the operator enables it with the flow capture setting)", http.StatusForbidden)
			return
		}
		if !h.admit() {
			http.Error(w, fmt.Sprintf("flows: too many observers (the limit is %d); try again later", h.cfg.MaxObservers), http.StatusTooManyRequests)
			return
		}
		defer h.release()
		if q.sse {
			w.Header().Set("Content-Type", ContentTypeSSE)
		} else {
			w.Header().Set("Content-Type", ContentTypeNDJSON)
		}
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if req.Method == http.MethodHead {
			return
		}
		w.WriteHeader(http.StatusOK)
		h.serve(req.Context(), w, r, q)
	})
}

// serve runs one observer until its context ends or, without follow, it has sent the ring.
func (h *Hub) serve(ctx context.Context, w http.ResponseWriter, r Resolver, q *request) {
	o := newObserver(h, q.filter, r, q.since)
	if q.capture {
		o.capture = true
		o.captureFlow = q.captureFlow
		o.captureLeft.Store(h.cfg.CaptureTotalBytes)
		o.payloads = make(chan *Payload, payloadQueue)
	}
	// Subscribe before the start is chosen: an event recorded after that pokes the observer.
	// The response's headers reach the client at the first flush, after the start is chosen:
	// a client that has them knows every event recorded from then on is in its stream (unless
	// lost, and then said).
	h.subscribe(o)
	defer h.unsubscribe(o)

	head := h.head.Load()
	var start uint64
	switch {
	case q.last >= 0:
		start = o.startLast(head, q.last)
	case !q.follow || !q.since.IsZero():
		start = h.oldest(head)
	default:
		start = head
	}
	st := &stream{w: w, rc: http.NewResponseController(w), sse: q.sse, hub: h}
	if q.rate > 0 {
		st.limiter = rate.NewLimiter(rate.Limit(q.rate), q.rate)
	}
	end := head
	if q.follow {
		end = ^uint64(0)
	}
	o.run(ctx, st, start, end)
}

// run sends the events from cursor on, up to end, in batches.
func (o *observer) run(ctx context.Context, st *stream, cursor, end uint64) {
	h := o.hub
	var e flow.Event
	var v view // escapes to the filters: one allocation per observer, reused for each event
	var coalesce *time.Timer
	for {
		// A client that stops reading holds its observer slot: give up on it when a batch
		// cannot be written for writeStall. Set per batch, as a long sleep between batches is
		// no stall. (It also lifts the server's WriteTimeout, which would end any long follow.)
		if err := st.rc.SetWriteDeadline(time.Now().Add(h.writeStall)); err != nil && !errors.Is(err, http.ErrNotSupported) {
			return
		}
		n := 0
		for ; n < batchMax && cursor < end; n++ {
			ok, lost := h.next(&cursor, &e, o.phases)
			st.lose(lostSlow, lost)
			if !ok {
				break
			}
			v = view{e: &e, r: o.res}
			if !o.pass(&v) {
				continue
			}
			if st.limiter != nil && !st.limiter.AllowN(h.cfg.Clock(), 1) {
				st.lose(lostRate, 1)
				continue
			}
			if e.Phase == flow.PhaseEnd {
				// The flow's payload was queued before its End was recorded: send it first, as
				// it happened (a capture reader closes the flow at End and drops what follows).
				o.drainPayloads(st)
			}
			st.flow(&v)
		}
		o.drainPayloads(st)
		st.flushLost()
		if err := st.flush(); err != nil || ctx.Err() != nil {
			return
		}
		if cursor >= end {
			return
		}
		if n == batchMax {
			continue
		}
		// Sleep until a writer pokes. Saying so before looking again means a writer that
		// finishes after the look sees sleeping and pokes: no wake-up is missed.
		o.sleeping.Store(true)
		if h.ready(cursor) {
			o.sleeping.Store(false)
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-o.wake:
			// Let events gather before reading them: an observer that keeps up would
			// otherwise be woken (a channel send and a goroutine switch, paid by the
			// writer) for every event. While it waits it is awake, so writers skip it.
			if h.coalesce > 0 {
				if coalesce == nil {
					coalesce = time.NewTimer(h.coalesce)
					defer coalesce.Stop()
				} else {
					coalesce.Reset(h.coalesce)
				}
				select {
				case <-ctx.Done():
					return
				case <-coalesce.C:
				}
			}
		case p := <-o.payloads: // nil channel without capture: never ready
			o.sleeping.Store(false)
			st.item(Item{Payload: p})
		}
	}
}

// drainPayloads sends the queued payload pieces and says how many the queue dropped.
func (o *observer) drainPayloads(st *stream) {
	if !o.capture {
		return
	}
	defer func() { st.lose(lostCapture, o.payloadsLost.Swap(0)) }() // the drops came after the queued pieces
	for range payloadQueue {
		select {
		case p := <-o.payloads:
			st.item(Item{Payload: p})
		default:
			return
		}
	}
}

// stream writes one observer's items.
type stream struct {
	w       io.Writer
	rc      *http.ResponseController
	sse     bool
	hub     *Hub
	limiter *rate.Limiter
	// pending counts, by reason, the events lost since the last Lost item.
	pending [numLostReasons]uint64
	// buf holds the items written since the last flush: a batch goes out in one write, so
	// the observer pays one system call (and one chunk) per batch, not one per few items.
	buf []byte
	err error
}

// flushAt is how much a batch may gather before it is written anyway.
const flushAt = 64 << 10

// lose counts n events lost: they are said (one Lost item per reason) before the next item and
// at the end of the batch.
func (s *stream) lose(r lostReason, n uint64) {
	if n == 0 {
		return
	}
	s.pending[r] += n
	s.hub.lost[r].Add(n)
}

func (s *stream) flushLost() {
	for r, n := range s.pending {
		if n == 0 {
			continue
		}
		s.pending[r] = 0
		s.write(Item{Lost: &Lost{Time: s.hub.cfg.Clock(), Node: s.hub.cfg.Node, Count: n, Reason: lostReasonNames[r]}})
	}
}

// item writes it after any pending Lost items.
func (s *stream) item(it Item) {
	s.flushLost()
	s.write(it)
}

func (s *stream) write(it Item) {
	if s.err != nil {
		return
	}
	j, err := json.Marshal(it)
	if err != nil {
		s.err = fmt.Errorf("flows: encode item: %w", err)
		return
	}
	s.send(append(s.begin(), j...))
}

// flow writes the flow item of v after any pending Lost items.
func (s *stream) flow(v *view) {
	s.flushLost()
	if s.err != nil {
		return
	}
	s.send(appendFlowItem(s.begin(), v))
}

// begin starts an item at the end of the batch's buffer.
func (s *stream) begin() []byte {
	if s.sse {
		return append(s.buf, "data: "...)
	}
	return s.buf
}

// send ends the item that b appended to the batch, and writes the batch when it is large.
func (s *stream) send(b []byte) {
	if s.sse {
		b = append(b, '\n', '\n')
	} else {
		b = append(b, '\n')
	}
	s.buf = b
	if len(s.buf) >= flushAt {
		s.writeOut()
	}
}

// writeOut writes the batch gathered so far.
func (s *stream) writeOut() {
	if len(s.buf) == 0 || s.err != nil {
		return
	}
	if _, err := s.w.Write(s.buf); err != nil {
		s.err = fmt.Errorf("flows: write: %w", err)
	}
	s.buf = s.buf[:0]
}

func (s *stream) flush() error {
	s.writeOut()
	if s.err != nil {
		return s.err
	}
	if err := s.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		s.err = fmt.Errorf("flows: flush: %w", err)
	}
	return s.err
}
