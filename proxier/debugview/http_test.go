package debugview

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
)

func TestServicesTextShowsEachPortAndItsPolicyLines(t *testing.T) {
	srv := serve(t, sampleSource())
	_, text := testenv.Get(t, srv.URL+"/debug/services")
	for _, want := range []string{
		"ns/echo:tcp", "10.96.0.7:80", "127.0.0.1:8080(ready)",
		"cluster traffic: 127.0.0.1:8080 [policy=Cluster]",
		"balancing: round-robin active[127.0.0.1:8080=1]",
		"connections: proxy-protocol v2 hold[1m0s, 1 held, max 1024]",
		"connections: source transparent",
		"cluster traffic: HELD (no endpoint; new connections wait for one) [policy=Cluster]",
		"path kernel: 10.244.1.5:8080 KUBE-SEP-AFGSLHOD2HFNCBX4 12 connections (720 B first packets)",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("/debug/services text lacks %q:\n%s", want, text)
		}
	}
}

func TestViewsAnswerJSONWhenAskedFor(t *testing.T) {
	src := sampleSource()
	srv := serve(t, src)
	tests := []struct {
		name, path, accept string
		into, want         any
	}{
		{"services_format_query", "/debug/services?format=json", "", &[]ServiceView{}, &src.services},
		{"services_accept_header", "/debug/services", "application/json", &[]ServiceView{}, &src.services},
		{"connections_format_query", "/debug/connections?format=json", "", &[]ConnView{}, &src.conns},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodGet, srv.URL+tc.path, nil)
			if tc.accept != "" {
				req.Header.Set("Accept", tc.accept)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q, want application/json", ct)
			}
			if err := json.NewDecoder(resp.Body).Decode(tc.into); err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, tc.into); diff != "" {
				t.Errorf("decoded views (-want +got):\n%s", diff)
			}
		})
	}
}

func TestConnectionsPassTheFiltersToTheSource(t *testing.T) {
	src := sampleSource()
	srv := serve(t, src)
	testenv.Get(t, srv.URL+"/debug/connections?service=ns/echo&client=127.0.0.1")
	src.mu.Lock()
	defer src.mu.Unlock()
	if want := [][2]string{{"ns/echo", "127.0.0.1"}}; !cmp.Equal(src.asked, want) {
		t.Errorf("Connections asked with %q, want %q", src.asked, want)
	}
}

func TestStatusPageOnlyAtTheRoot(t *testing.T) {
	srv := serve(t, sampleSource())
	if status, body := testenv.Get(t, srv.URL+"/"); status != http.StatusOK || !strings.Contains(body, "<title>kube-portal-proxy</title>") {
		t.Errorf("GET / = %d, want 200 and the status page; body:\n%s", status, body)
	}
	if status, _ := testenv.Get(t, srv.URL+"/other"); status != http.StatusNotFound {
		t.Errorf("GET /other = %d, want 404", status)
	}
}
