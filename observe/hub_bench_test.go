package observe

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/flow"
)

// BenchmarkRecord measures the data path's cost of one event: with no observer, and with ten
// observers following over HTTP (each in its own request goroutine, read by a client that
// discards), their filters passing every event or none.
func BenchmarkRecord(b *testing.B) {
	b.Run("observers=0", func(b *testing.B) { benchRecord(b, 0, "") })
	b.Run("observers=0/parallel", func(b *testing.B) { benchRecordParallel(b, 0, "") })
	b.Run("observers=10/pass", func(b *testing.B) { benchRecord(b, 10, "service=default/web&not-verdict=refused") })
	b.Run("observers=10/pass/parallel", func(b *testing.B) { benchRecordParallel(b, 10, "service=default/web&not-verdict=refused") })
	b.Run("observers=10/refuse", func(b *testing.B) { benchRecord(b, 10, "namespace=kube-system") })
	// The data path's own share with ten observers, without their CPU competing on a small
	// machine: subscribed, awake (so Record looks at each and pokes none), reading nothing.
	b.Run("observers=10/subscribed-only", func(b *testing.B) {
		h := NewHub(HubConfig{})
		for range 10 {
			o := newObserver(h, nil, nil, time.Time{})
			h.subscribe(o)
			b.Cleanup(func() { h.unsubscribe(o) })
		}
		rec, e := h.ForPort(webPort), webEvent(1)
		b.ReportAllocs()
		for b.Loop() {
			rec.Record(e)
		}
	})
}

func benchRecord(b *testing.B, observers int, filter string) {
	rec := benchHub(b, observers, filter)
	e := webEvent(1)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		rec.Record(e)
	}
}

func benchRecordParallel(b *testing.B, observers int, filter string) {
	rec := benchHub(b, observers, filter)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		e := webEvent(1)
		for pb.Next() {
			rec.Record(e)
		}
	})
}

// benchHub serves a hub to observers following with filter, and returns the web port's
// Recorder. The observers end with the benchmark.
func benchHub(b *testing.B, observers int, filter string) flow.Recorder {
	h := NewHub(HubConfig{})
	srv := httptest.NewServer(h.Handler(&lockedResolver{}))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	b.Cleanup(func() {
		cancel()
		wg.Wait()
		srv.Close()
	})
	for range observers {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/debug/flows?follow=1&"+filter, nil)
		if err != nil {
			b.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req) // returns once the observer is subscribed
		if err != nil {
			b.Fatal(err)
		}
		wg.Go(func() {
			defer resp.Body.Close()
			io.Copy(io.Discard, resp.Body) // ends when ctx does
		})
	}
	if got := h.Stats().Observers; got != observers {
		b.Fatalf("%d observers, want %d", got, observers)
	}
	return h.ForPort(webPort)
}

// BenchmarkStreamEvent is an observer's cost for one event it sends: filter, convert (pods
// named), encode, write. Ten observers at full rate pay it ten times per event, on the cores
// the data path shares.
func BenchmarkStreamEvent(b *testing.B) {
	h := NewHub(HubConfig{})
	f, err := ParseFilter(map[string][]string{"service": {"default/web"}, "not-verdict": {"refused"}})
	if err != nil {
		b.Fatal(err)
	}
	o := newObserver(h, f, &lockedResolver{}, time.Time{})
	w := httptest.NewRecorder()
	st := &stream{w: io.Discard, rc: http.NewResponseController(w), hub: h}
	e := *webEvent(1)
	e.Port = webPort
	b.ReportAllocs()
	var v view
	for b.Loop() {
		v = view{e: &e, r: o.res}
		if !o.pass(&v) {
			b.Fatal("filtered out")
		}
		st.flow(&v)
	}
}
