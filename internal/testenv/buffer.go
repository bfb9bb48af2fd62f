package testenv

import (
	"bytes"
	"strings"
	"sync"
)

// SyncBuffer is a bytes.Buffer that goroutines (a logger, a child process's output copier) may
// write while the test reads it.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String is everything written so far.
func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Lines is everything written so far, split into lines (without the last newline).
func (b *SyncBuffer) Lines() []string {
	return strings.Split(strings.TrimSpace(b.String()), "\n")
}
