package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/kube-portal-proxy/kube-portal-proxy/handover"
	"github.com/kube-portal-proxy/kube-portal-proxy/healthcheck"
)

// httpServer is one HTTP address and what it serves; an empty address disables it. limited
// servers face outside (the health address) and take healthcheck.Limits' defaults.
type httpServer struct {
	addr    string
	handler http.Handler
	limited bool
}

// listenHTTP opens every server's listener, so an address in use fails the start, and returns
// the tasks that serve them until their context ends. An address the running proxy handed over
// (inh) is taken over rather than bound; with --handover-socket, an address in use is probably
// the running proxy's, which did not hand it over: it is served once free (serveWhenFree).
func (d *Daemon) listenHTTP(servers []httpServer, inh *handover.Inherited) ([]func(context.Context), error) {
	var tasks []func(context.Context)
	var opened []net.Listener
	for _, s := range servers {
		if s.addr == "" {
			continue
		}
		ln, ok := inh.Listener("tcp", s.addr)
		var err error
		if !ok {
			ln, err = d.deps.listen(s.addr)
		}
		if d.inUseByPredecessor(err) {
			tasks = append(tasks, d.serveWhenFree(s, err))
			continue
		}
		if err != nil {
			for _, l := range opened {
				_ = l.Close()
			}
			return nil, fmt.Errorf("listen %s: %w", s.addr, err)
		}
		opened = append(opened, ln)
		tasks = append(tasks, serveHTTP(ln, s, d.log.WithField("address", s.addr)))
	}
	return tasks, nil
}

// serveWhenFree serves s once its address is free (bindWhenFree): the running proxy holds it.
func (d *Daemon) serveWhenFree(s httpServer, inUse error) func(context.Context) {
	log := d.log.WithField("address", s.addr)
	log.WithError(inUse).Warn("Address in use, probably by the running proxy, which did not hand it over; serving it once it lets go")
	return func(ctx context.Context) {
		ln, err := d.bindWhenFree(ctx, s.addr)
		if err != nil {
			if ctx.Err() == nil {
				log.WithError(err).Error("Cannot listen; this address stays unserved until a restart")
			}
			return
		}
		log.Info("Address free at last: serving it")
		serveHTTP(ln, s, log)(ctx)
	}
}

// serveHTTP serves s on ln until ctx is done, then shuts the server down: a second for requests
// in flight, then connections are closed.
func serveHTTP(ln net.Listener, s httpServer, log logrus.FieldLogger) func(context.Context) {
	return func(ctx context.Context) {
		srv := &http.Server{Handler: s.handler, ReadHeaderTimeout: 10 * time.Second}
		if s.limited {
			ln, srv = healthcheck.Limits{}.Serve(ln, s.handler)
		}
		stopped := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			defer close(stopped)
			sctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			if srv.Shutdown(sctx) != nil {
				_ = srv.Close()
			}
		})
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.WithError(err).Error("HTTP server stopped")
		}
		if !stop() {
			<-stopped
		}
	}
}
