package iptables

import (
	"context"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/kube-portal-proxy/kube-portal-proxy/portal"
)

// joinInput is the text of in written the plain way: every line a string, then joined.
func joinInput(in input) string {
	var lines []string
	for _, part := range in.parts {
		for _, ls := range part {
			if ls.rules == nil {
				lines = append(lines, ls.prefix)
			}
			for _, r := range ls.rules {
				lines = append(lines, ls.prefix+r)
			}
		}
	}
	if len(lines) == 0 {
		return ""
	}
	return "*" + in.table + "\n" + strings.Join(lines, "\n") + "\n" + commitLine
}

// TestInputText: an input's text, whole (bytes, for runners that take it so) or read as the
// command consumes it (reader, ExecRunner), is its lines in order, also across the reader's
// chunks (a first sync of 2,000 ports is several chunks) and for readers that read a byte at a
// time; an input without lines is no text.
func TestInputText(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts, cfg.KernelPath = true, true
	for _, n := range []int{1, 2000} {
		specs := manySpecs(n, 20000)
		want, _ := buildRules(cfg.withDefaults(), portal.IPv4, specs)
		for _, table := range tables {
			pl := restorePlan(table, newTableState(), want[table], false)
			for _, in := range []input{pl.apply, pl.cleanup} {
				text := joinInput(in)
				if got := string(in.bytes()); got != text {
					t.Errorf("%d ports, %s: bytes differ from the lines (-want +got):\n%s", n, table, lineDiff(text, got))
				}
				if in.size() != len(text) {
					t.Errorf("%d ports, %s: size %d, the text is %d bytes", n, table, in.size(), len(text))
				}
				if text == "" {
					if in.bytes() != nil {
						t.Errorf("%d ports, %s: an input without lines has text", n, table)
					}
					continue
				}
				if err := iotest.TestReader(in.reader(), []byte(text)); err != nil {
					t.Errorf("%d ports, %s: reader: %v", n, table, err)
				}
				if n > 1 && table == tableNAT && len(text) < 2*readChunk {
					t.Errorf("the nat input of %d ports is %d bytes, under two chunks: the test reads no chunk boundary", n, len(text))
				}
			}
		}
	}
}

// streamingFake is Fake behind RestoreFrom, counting the restores that came whole.
type streamingFake struct {
	*Fake
	whole, streamed int
}

func (f *streamingFake) Restore(ctx context.Context, fam portal.Family, data []byte) error {
	f.whole++
	return f.Fake.Restore(ctx, fam, data)
}

func (f *streamingFake) RestoreFrom(ctx context.Context, fam portal.Family, input io.Reader) error {
	f.streamed++
	data, err := io.ReadAll(input)
	if err != nil {
		return err
	}
	return f.Fake.Restore(ctx, fam, data)
}

// TestSyncStreamsToStreamingRunners: with a runner that can read the input as the command
// consumes it (ExecRunner), every sync restore is streamed, never built whole, and programs what
// a whole input does.
func TestSyncStreamsToStreamingRunners(t *testing.T) {
	cfg := v4Config()
	cfg.ProtectProxyPorts, cfg.KernelPath, cfg.NoRandomFully = true, true, true
	f := &streamingFake{Fake: NewFake()}
	whole := NewFake()
	for _, r := range []Runner{f, whole} {
		specs := manySpecs(300, 20000)
		p := New(cfg, r)
		mustSync(t, p, specs)
		specs[7].ProxyPort = 65000 // a head insert and a delete
		mustSync(t, p, specs)
	}
	if f.whole != 0 || f.streamed == 0 {
		t.Errorf("restores: %d whole, %d streamed; want all streamed", f.whole, f.streamed)
	}
	if d := lineDiff(whole.Dump(), f.Dump()); d != "" {
		t.Errorf("streamed restores programmed other rules than whole ones (-whole +streamed):\n%s", d)
	}
}
