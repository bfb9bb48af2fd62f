package daemon

// snapshot.go: the restart snapshot (--restart-snapshot-file). A running proxy keeps what it
// serves in the file, written at most once per snapshotPeriod and only when something changed;
// a process started without a hand-over (SIGKILL, OOM kill, crash) reads it before its sources
// start, so the proxy ports it reopens serve held and new connections from the snapshot's
// endpoints while the initial lists decode (proxier.Restore), instead of holding them for the
// whole cold start.

import (
	"context"
	"iter"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"k8s.io/utils/clock"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
)

// snapshotPeriod bounds how often the snapshot is written: churn of any rate costs at most one
// write (26 ms of CPU at 10,000 ports) per period, and a restart finds the state of at most about
// a period ago.
const snapshotPeriod = time.Second

// snapshotActivityPeriod is how often the writer looks at the sockets' counters
// (proxier.NoteActivity: 10,000 ports in 1.4 ms of CPU), and so bounds how often activity alone
// rewrites the snapshot: only when a port became active that the file does not have as recently
// active (the proxier's activityRefresh), at most once per period (a write of 10,000 ports: 9 ms
// of CPU). A port first used in the last few seconds before a crash is reopened in name order.
const snapshotActivityPeriod = 5 * time.Second

// snapshotSource is the proxier's side of the snapshot.
type snapshotSource interface {
	FirstSync() <-chan struct{}
	SnapshotGeneration() uint64
	SnapshotPorts() iter.Seq[*snapshot.Port]
	// NoteActivity stamps the ports with traffic since the last call; it reports whether the
	// last snapshot taken misses some of it.
	NoteActivity(now time.Time) bool
}

// snapshotStats is what the restart snapshot did in this process, for the metrics.
type snapshotStats struct {
	restored atomic.Int64 // service ports restored at start
	age      atomic.Int64 // the restored snapshot's age at start, nanoseconds; -1: none
	writes   atomic.Int64
	failures atomic.Int64
	lastCost atomic.Int64 // nanoseconds the last write took (building, encoding, writing)
}

func newSnapshotStats() *snapshotStats {
	s := &snapshotStats{}
	s.age.Store(-1)
	return s
}

func (s *snapshotStats) collector() prometheus.Collector {
	restored := prometheus.NewDesc("kube_portal_proxy_restart_snapshot_restored_service_ports",
		"Service ports whose reopened sockets served from the restart snapshot's endpoints at start, until the initial Services and EndpointSlices were in (0: no snapshot used).", nil, nil)
	age := prometheus.NewDesc("kube_portal_proxy_restart_snapshot_age_seconds",
		"Age of the restart snapshot used at start, when it was read (absent: none used).", nil, nil)
	writes := prometheus.NewDesc("kube_portal_proxy_restart_snapshot_writes_total",
		"Restart snapshots written (at most one per second, only after a change).", []string{"result"}, nil)
	cost := prometheus.NewDesc("kube_portal_proxy_restart_snapshot_write_seconds",
		"How long the last restart snapshot write took (taking it, encoding, writing the file).", nil, nil)
	return collectorFunc{descs: []*prometheus.Desc{restored, age, writes, cost}, collect: func(ch chan<- prometheus.Metric) {
		ch <- prometheus.MustNewConstMetric(restored, prometheus.GaugeValue, float64(s.restored.Load()))
		if a := s.age.Load(); a >= 0 {
			ch <- prometheus.MustNewConstMetric(age, prometheus.GaugeValue, time.Duration(a).Seconds())
		}
		ch <- prometheus.MustNewConstMetric(writes, prometheus.CounterValue, float64(s.writes.Load()), "ok")
		ch <- prometheus.MustNewConstMetric(writes, prometheus.CounterValue, float64(s.failures.Load()), "failed")
		ch <- prometheus.MustNewConstMetric(cost, prometheus.GaugeValue, time.Duration(s.lastCost.Load()).Seconds())
	}}
}

// restorer is the proxier's side of a restore.
type restorer interface {
	Restore(st *snapshot.State) int
}

// restoreSnapshot reads the snapshot and hands it to the proxier, after Reopen and before the
// sources start, and removes the temporary files of a write the previous process was killed in. A successor of a hand-over does not: its predecessor serves until it has synced.
// A snapshot that is unreadable, of another version or node is logged once and ignored.
func restoreSnapshot(path, node string, handedOver bool, px restorer, stats *snapshotStats, clk clock.PassiveClock, log logrus.FieldLogger) {
	applySnapshot(readSnapshot(path, node, handedOver, clk, log), px, stats, clk, log)
}

// readSnapshot is the first half of restoreSnapshot: the state read, nil when there is none to
// use.
func readSnapshot(path, node string, handedOver bool, clk clock.PassiveClock, log logrus.FieldLogger) *readState {
	if path == "" || handedOver {
		return nil
	}
	start := clk.Now()
	// No process writes now (the previous one is gone), so a temporary file is a killed write's.
	if err := snapshot.RemoveStale(path); err != nil {
		log.WithError(err).Warn("Cannot remove the temporary files of an interrupted restart snapshot write")
	}
	st, err := snapshot.Read(path, node)
	if err != nil {
		log.WithError(err).Warn("Ignoring the restart snapshot; reopened proxy ports hold connections until the initial lists are in")
		return nil
	}
	if st == nil {
		return nil
	}
	return &readState{st: st, at: start, took: clk.Since(start)}
}

// readState is a snapshot read at start, and when and how long that took.
type readState struct {
	st   *snapshot.State
	at   time.Time
	took time.Duration
}

// applySnapshot is the second half of restoreSnapshot: the proxier serves the reopened ports
// from the state read (nil: nothing to do).
func applySnapshot(rs *readState, px restorer, stats *snapshotStats, clk clock.PassiveClock, log logrus.FieldLogger) {
	if rs == nil {
		return
	}
	start := clk.Now()
	n := px.Restore(rs.st)
	age := rs.at.Sub(rs.st.Written)
	stats.restored.Store(int64(n))
	stats.age.Store(int64(max(age, 0)))
	log.WithFields(logrus.Fields{"restoredServicePorts": n, "snapshotServicePorts": len(rs.st.Ports), "snapshotAge": age.Round(time.Millisecond).String(),
		"duration": (rs.took + clk.Since(start)).String()}).Info("Serving the reopened proxy ports from the restart snapshot until the initial Services and EndpointSlices are in")
}

// snapshotWriter writes the snapshot after the first sync, then whenever the proxier's state
// changed, at most once per period, and when ports became active that the file misses, at most
// once per activityPeriod (on a cluster where nothing changes, the file still learns which ports
// the node's clients use). It runs until ctx is done (a process that handed over stops
// writing: its successor owns the file).
type snapshotWriter struct {
	path, node string
	src        snapshotSource
	clock      clock.Clock
	period     time.Duration
	// activityPeriod bounds the rewrites for activity alone (snapshotActivityPeriod).
	activityPeriod time.Duration
	stats          *snapshotStats
	log            logrus.FieldLogger
}

func (w *snapshotWriter) Run(ctx context.Context) {
	// Before the first sync the proxier serves (part of) the previous snapshot: writing it
	// would only lose what the sources have not delivered yet.
	select {
	case <-w.src.FirstSync():
	case <-ctx.Done():
		return
	}
	t := w.clock.NewTimer(w.period)
	defer t.Stop()
	written, failing, active := false, false, false
	var last uint64
	var looked time.Time
	for {
		if now := w.clock.Now(); looked.IsZero() || now.Sub(looked) >= w.activityPeriod {
			// Sticky until written: the proxier counts a port as filed once a snapshot took
			// it, written or not.
			active = w.src.NoteActivity(now) || active
			looked = now
		}
		if gen := w.src.SnapshotGeneration(); !written || gen != last || active {
			start := w.clock.Now()
			err := snapshot.WritePorts(w.path, w.node, start, w.src.SnapshotPorts())
			w.stats.lastCost.Store(int64(w.clock.Since(start)))
			if err == nil {
				written, last, active = true, gen, false
				w.stats.writes.Add(1)
			} else {
				w.stats.failures.Add(1)
			}
			if err != nil && !failing {
				w.log.WithError(err).Warn("Cannot write the restart snapshot; a restart after a crash holds connections until the initial lists are in")
			} else if err == nil && failing {
				w.log.Info("Writing the restart snapshot again")
			}
			failing = err != nil
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			t.Reset(w.period)
		}
	}
}
