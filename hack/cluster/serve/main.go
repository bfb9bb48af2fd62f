// Command serve is the test workload of make cluster's smoke test, small enough to image
// without a registry: an HTTP server that answers every request with the pod's host name, and a
// client mode for use with kubectl exec.
//
//	serve -listen :8080          answer "<hostname>\n"
//	serve -get URL [-timeout D]  print the body of GET URL; exit 1 on any error
//	serve -listen :8080 -probe URL [-probe URL...] [-probe-every D] [-probe-for D]
//	                             also GET each URL on a new connection every D, counting
//	                             answers and failures: GET /stats, GET /stop (probe.go)
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	listen := flag.String("listen", ":8080", "address to serve on")
	get := flag.String("get", "", "fetch this URL, print its body and exit")
	timeout := flag.Duration("timeout", 5*time.Second, "deadline of -get and of each -probe request")
	var urls urlList
	flag.Var(&urls, "probe", "GET this URL in a loop (repeatable)")
	every := flag.Duration("probe-every", 20*time.Millisecond, "interval of the -probe requests")
	limit := flag.Duration("probe-for", 10*time.Minute, "stop the -probe loops after this long at the latest")
	flag.Parse()
	if *get != "" {
		if err := fetch(*get, *timeout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	host, err := os.Hostname()
	if err != nil {
		log.Fatal(err)
	}
	var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, host)
	})
	if len(urls) > 0 {
		h = startProbes(urls, *every, *timeout, *limit).handle(h)
	}
	srv := &http.Server{Addr: *listen, ReadHeaderTimeout: 5 * time.Second, Handler: h}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(shutdown) //nolint:errcheck // exiting anyway
	}()
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		log.Fatal(err)
	}
}

func fetch(url string, timeout time.Duration) error {
	c := &http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}

// urlList is a repeatable flag.
type urlList []string

func (l *urlList) String() string     { return strings.Join(*l, ",") }
func (l *urlList) Set(v string) error { *l = append(*l, v); return nil }
