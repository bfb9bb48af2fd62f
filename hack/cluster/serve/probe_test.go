package main

// Address plan: every server is a loopback httptest server (127.0.0.1, a kernel-chosen port);
// the refused URL is a loopback port whose listener was closed.

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

// counts reads ok= and failed= of a probe's /stats line.
func counts(t *testing.T, line string) (ok, failed int) {
	t.Helper()
	m := regexp.MustCompile(` ok=(\d+) failed=(\d+) `).FindStringSubmatch(line)
	if m == nil {
		t.Fatalf("stats line %q has no ok= failed=", line)
	}
	ok, _ = strconv.Atoi(m[1])
	failed, _ = strconv.Atoi(m[2])
	return ok, failed
}

func TestProbe(t *testing.T) {
	t.Run("counts_the_answers_of_each_host_on_a_new_connection_each", func(t *testing.T) {
		var requests, conns atomic.Int64
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, "pod-%d\n", requests.Add(1)%2)
		}))
		srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				conns.Add(1)
			}
		}
		srv.Start()
		defer srv.Close()

		ps := startProbes([]string{srv.URL}, time.Millisecond, time.Second, time.Minute)
		testenv.WaitFor(t, "10 answers", func() bool { ok, _ := counts(t, ps.list[0].String()); return ok >= 10 })
		ps.stop()

		line := ps.list[0].String()
		ok, failed := counts(t, line)
		if failed != 0 {
			t.Errorf("failed = %d, want 0: %s", failed, line)
		}
		if !regexp.MustCompile(`answers=pod-0:\d+,pod-1:\d+ `).MatchString(line) {
			t.Errorf("answers of both hosts not counted: %s", line)
		}
		if got := conns.Load(); got != int64(ok) {
			t.Errorf("%d connections for %d answers, want one each (no keep-alive)", got, ok)
		}
	})

	t.Run("counts_refused_connections_as_failures_with_the_first_errors", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		url := "http://" + ln.Addr().String() + "/"
		ln.Close()

		ps := startProbes([]string{url}, time.Millisecond, time.Second, time.Minute)
		testenv.WaitFor(t, "10 failures", func() bool { _, f := counts(t, ps.list[0].String()); return f >= 10 })
		ps.stop()

		line := ps.list[0].String()
		if ok, _ := counts(t, line); ok != 0 {
			t.Errorf("ok = %d, want 0: %s", ok, line)
		}
		if n := len(regexp.MustCompile(`connection refused`).FindAllString(line, -1)); n != maxErrors {
			t.Errorf("%d errors kept, want the first %d: %s", n, maxErrors, line)
		}
	})

	t.Run("counts_an_error_status_as_a_failure", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, "no", http.StatusServiceUnavailable)
		}))
		defer srv.Close()

		ps := startProbes([]string{srv.URL}, time.Millisecond, time.Second, time.Minute)
		testenv.WaitFor(t, "a failure", func() bool { _, f := counts(t, ps.list[0].String()); return f >= 1 })
		ps.stop()
		if ok, _ := counts(t, ps.list[0].String()); ok != 0 {
			t.Errorf("ok = %d, want 0: %s", ok, ps.list[0])
		}
	})

	t.Run("stop_freezes_the_counts_and_answers_them", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintln(w, "pod")
		}))
		defer srv.Close()
		ps := startProbes([]string{srv.URL, srv.URL + "/other"}, time.Millisecond, time.Second, time.Minute)
		h := ps.handle(http.NotFoundHandler())
		testenv.WaitFor(t, "an answer on both", func() bool {
			a, _ := counts(t, ps.list[0].String())
			b, _ := counts(t, ps.list[1].String())
			return a > 0 && b > 0
		})

		stopped := httptest.NewRecorder()
		h.ServeHTTP(stopped, httptest.NewRequest("GET", "/stop", nil))
		// Every probe has returned (stop waits), so nothing can count after it.
		later := httptest.NewRecorder()
		h.ServeHTTP(later, httptest.NewRequest("GET", "/stats", nil))
		if stopped.Body.String() != later.Body.String() {
			t.Errorf("counts changed after /stop:\n%s\nthen\n%s", stopped.Body, later.Body)
		}
		if n := len(regexp.MustCompile(`(?m)^http://\S+ ok=\d+ failed=0 `).FindAllString(stopped.Body.String(), -1)); n != 2 {
			t.Errorf("/stop answered %d probe lines without failures, want 2:\n%s", n, stopped.Body)
		}
		other := httptest.NewRecorder()
		h.ServeHTTP(other, httptest.NewRequest("GET", "/", nil))
		if other.Code != http.StatusNotFound {
			t.Errorf("GET / = %d, want the next handler's 404", other.Code)
		}
	})

	t.Run("stops_by_itself_after_the_limit", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintln(w, "pod")
		}))
		defer srv.Close()
		ps := startProbes([]string{srv.URL}, time.Millisecond, time.Second, 50*time.Millisecond)
		testenv.WaitFor(t, "the probes to end at the limit", func() bool {
			select {
			case <-ps.done:
				return true
			default:
				return false
			}
		})
	})
}
