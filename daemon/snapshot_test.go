package daemon

// Address plan: one endpoint 10.244.1.1:8080; files in a temporary directory.

import (
	"context"
	"errors"
	"iter"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/testenv"
	"github.com/kube-portal-proxy/kube-portal-proxy/proxier/snapshot"
	"github.com/kube-portal-proxy/kube-portal-proxy/service"
)

var snapWeb = service.ServicePortName{Namespace: "ns", Name: "web", Port: "http"}

// fakeSnapshots is a proxier whose state the test changes.
type fakeSnapshots struct {
	first chan struct{}
	asked atomic.Bool // FirstSync was called: the writer is waiting on it
	gen   atomic.Uint64
	taken atomic.Int64
	// active: ports became active that the last snapshot taken misses (NoteActivity's answer,
	// once).
	active atomic.Bool
}

func (f *fakeSnapshots) NoteActivity(time.Time) bool { return f.active.Swap(false) }

func (f *fakeSnapshots) FirstSync() <-chan struct{} { f.asked.Store(true); return f.first }
func (f *fakeSnapshots) SnapshotGeneration() uint64 { return f.gen.Load() }
func (f *fakeSnapshots) SnapshotPorts() iter.Seq[*snapshot.Port] {
	f.taken.Add(1)
	return slices.Values([]*snapshot.Port{{Name: snapWeb, Protocol: service.TCP,
		Internal: []snapshot.Endpoint{{Addr: netip.MustParseAddrPort("10.244.1.1:8080"), Ready: true, Serving: true}}}})
}

func TestSnapshotWriter(t *testing.T) {
	path := filepath.Join(t.TempDir(), "restart-snapshot")
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	src := &fakeSnapshots{first: make(chan struct{})}
	stats := newSnapshotStats()
	w := &snapshotWriter{path: path, node: "node-a", src: src, clock: clk, period: time.Second, stats: stats, log: logrus.New()}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()

	t.Run("nothing_before_the_first_sync", func(t *testing.T) {
		// Wait until the writer has done its first thing: asked for the first sync (and so
		// waits on it), or, a writer that does not wait, taken a snapshot. Periods passing
		// before the first sync change nothing either.
		testenv.WaitFor(t, "the writer to start", func() bool { return src.asked.Load() || src.taken.Load() > 0 })
		for range 3 {
			clk.Step(time.Second)
		}
		if n := src.taken.Load(); n != 0 {
			t.Errorf("%d snapshots taken before the first sync; want none", n)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("snapshot written before the first sync: %v", err)
		}
	})
	close(src.first)
	t.Run("written_after_the_first_sync", func(t *testing.T) {
		testenv.WaitFor(t, "the first write", func() bool { return stats.writes.Load() == 1 })
		st, err := snapshot.Read(path, "node-a")
		if err != nil || st == nil || len(st.Ports) != 1 || st.Ports[0].Name != snapWeb {
			t.Fatalf("Read = %+v, %v; want web", st, err)
		}
	})
	t.Run("no_change_no_write", func(t *testing.T) {
		for range 3 {
			testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
			clk.Step(time.Second)
		}
		testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
		if n := src.taken.Load(); n != 1 {
			t.Errorf("%d snapshots taken over three unchanged periods; want the first only", n)
		}
	})
	t.Run("changes_within_a_period_cost_one_write", func(t *testing.T) {
		for range 100 {
			src.gen.Add(1)
		}
		testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
		clk.Step(time.Second)
		testenv.WaitFor(t, "the second write", func() bool { return stats.writes.Load() == 2 })
		testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
		clk.Step(time.Second)
		testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
		if n := stats.writes.Load(); n != 2 {
			t.Errorf("%d writes; want 2 (the first, then one for 100 changes)", n)
		}
	})
}

// TestSnapshotWriterRewritesForActivity: on a cluster where nothing changes the snapshot is still
// rewritten when ports became active that it misses, at most once per activity period, so a
// restart reopens the ports in use first.
func TestSnapshotWriterRewritesForActivity(t *testing.T) {
	path := filepath.Join(t.TempDir(), "restart-snapshot")
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	src := &fakeSnapshots{first: make(chan struct{})}
	close(src.first)
	stats := newSnapshotStats()
	w := &snapshotWriter{path: path, node: "node-a", src: src, clock: clk, period: time.Second, activityPeriod: 5 * time.Second, stats: stats, log: logrus.New()}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	testenv.WaitFor(t, "the first write", func() bool { return stats.writes.Load() == 1 })
	step := func() {
		testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
		clk.Step(time.Second)
	}
	// Activity within the activity period of the first write waits for its end.
	src.active.Store(true)
	for range 3 {
		step()
	}
	testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
	if n := stats.writes.Load(); n != 1 {
		t.Fatalf("%d writes 3 s after the first; want 1 (activity waits for the period)", n)
	}
	step()
	step()
	testenv.WaitFor(t, "the write for activity", func() bool { return stats.writes.Load() == 2 })
	// No more activity: no more writes.
	for range 10 {
		step()
	}
	testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
	if n := stats.writes.Load(); n != 2 {
		t.Errorf("%d writes without changes or activity; want 2", n)
	}
}

func TestSnapshotWriterFailureLoggedOnce(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	src := &fakeSnapshots{first: make(chan struct{})}
	close(src.first)
	stats := newSnapshotStats()
	log, hook := logtest.NewNullLogger()
	w := &snapshotWriter{path: filepath.Join(t.TempDir(), "missing", "snap"), node: "n", src: src, clock: clk, period: time.Second, stats: stats, log: log}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(ctx) })
	for range 3 {
		testenv.WaitFor(t, "the writer to wait", clk.HasWaiters)
		clk.Step(time.Second)
	}
	testenv.WaitFor(t, "three failed writes", func() bool { return stats.failures.Load() >= 3 })
	cancel()
	wg.Wait()
	if n := len(hook.AllEntries()); n != 1 {
		t.Errorf("%d log lines for %d failed writes; want 1", n, stats.failures.Load())
	}
}

// countingRestorer records what it was given.
type countingRestorer struct{ got *snapshot.State }

func (c *countingRestorer) Restore(st *snapshot.State) int { c.got = st; return len(st.Ports) }

func TestRestoreSnapshot(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_010, 0))
	good := filepath.Join(t.TempDir(), "snap")
	if err := snapshot.WritePorts(good, "node-a", time.Unix(1_700_000_000, 0), (&fakeSnapshots{}).SnapshotPorts()); err != nil {
		t.Fatal(err)
	}
	corrupt := filepath.Join(t.TempDir(), "snap")
	if err := os.WriteFile(corrupt, []byte("KPPSNAP\nnot really"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, node string
		handedOver       bool
		restored         bool
		logs             int
	}{
		{"restored_with_its_age", good, "node-a", false, true, 1},
		{"not_after_a_hand_over", good, "node-a", true, false, 0},
		{"another_node_ignored", good, "node-b", false, false, 1},
		{"corrupt_ignored", corrupt, "node-a", false, false, 1},
		// Written by a build of format version 1 (before the ports' last activity): the start
		// goes on without it.
		{"older_version_ignored", filepath.Join("..", "proxier", "snapshot", "testdata", "version1.snap"), "node-a", false, false, 1},
		{"none", filepath.Join(t.TempDir(), "none"), "node-a", false, false, 0},
		{"off", "", "node-a", false, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log, hook := logtest.NewNullLogger()
			px, stats := &countingRestorer{}, newSnapshotStats()
			restoreSnapshot(tc.path, tc.node, tc.handedOver, px, stats, clk, log)
			if (px.got != nil) != tc.restored {
				t.Errorf("restored = %v; want %v", px.got != nil, tc.restored)
			}
			if n := len(hook.AllEntries()); n != tc.logs {
				t.Errorf("%d log lines; want %d", n, tc.logs)
			}
			if tc.restored && (stats.restored.Load() != 1 || time.Duration(stats.age.Load()) != 10*time.Second) {
				t.Errorf("stats: %d restored, age %v; want 1, 10s", stats.restored.Load(), time.Duration(stats.age.Load()))
			}
			if !tc.restored && stats.age.Load() != -1 {
				t.Errorf("age %v without a restore; want none", stats.age.Load())
			}
		})
	}
}
