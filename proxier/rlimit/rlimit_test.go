package rlimit

import (
	"testing"

	"golang.org/x/sys/unix"
)

func current(t *testing.T) unix.Rlimit {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatalf("getrlimit: %v", err)
	}
	return lim
}

func TestRaiseNoFile(t *testing.T) {
	hard := current(t).Max
	tests := []struct {
		name      string
		want      uint64
		wantSoft  uint64
		wantShort bool
	}{
		// Go already raises the soft limit to the hard one at start; asking for it changes nothing.
		{name: "up_to_hard_limit", want: hard, wantSoft: hard},
		// Beyond fs.nr_open even root cannot go: the soft limit stays at the hard one and is reported short.
		{name: "beyond_nr_open_is_short_not_fatal", want: 1 << 40, wantSoft: hard, wantShort: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := RaiseNoFile(tt.want)
			if err != nil {
				t.Fatalf("RaiseNoFile(%d): %v", tt.want, err)
			}
			if got := current(t).Cur; got != tt.wantSoft {
				t.Errorf("soft limit after RaiseNoFile(%d) (-want +got):\n-%d\n+%d", tt.want, tt.wantSoft, got)
			}
			if res.Short() != tt.wantShort {
				t.Errorf("Short() = %v, want %v (%s)", res.Short(), tt.wantShort, res)
			}
		})
	}
}
