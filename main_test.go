package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRunExitCodes runs the command's actions that need no root and checks exit codes and output.
func TestRunExitCodes(t *testing.T) {
	out := filepath.Join(t.TempDir(), "effective.yaml")
	tests := []struct {
		name       string
		args       []string
		wantCode   int
		wantStdout string
		wantStderr string
	}{
		{"version", []string{"--version"}, 0, "kube-portal-proxy dev\n", ""},
		{"help", []string{"--help"}, 0, "", ""},
		{"unknown_flag", []string{"--no-such-flag"}, 2, "", "unknown flag: --no-such-flag"},
		{"invalid_value_names_the_flag", []string{"--udp-timeout=0s"}, 2, "", "kube-portal-proxy: --udp-timeout: must be > 0\n"},
		{"stray_argument", []string{"extra"}, 2, "", `unexpected arguments: ["extra"]`},
		{"write_config", []string{"--write-config-to=" + out}, 0, "", ""},
		{"observe_unknown_flag", []string{"observe", "--no-such-flag"}, 2, "", "kube-portal-proxy observe: unknown flag: --no-such-flag"},
		{"observe_bad_value_names_the_flag", []string{"observe", "--verdict=fine"}, 2, "", `kube-portal-proxy observe: --verdict: unknown verdict "fine"`},
		{"write_config_to_a_missing_directory", []string{"--write-config-to=" + filepath.Join(out, "x", "y.yaml")}, 1, "", "kube-portal-proxy: --write-config-to: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := run(context.Background(), tt.args, &stdout, &stderr)
			if code != tt.wantCode {
				t.Errorf("exit code %d, want %d (stderr %q)", code, tt.wantCode, stderr.String())
			}
			if stdout.String() != tt.wantStdout {
				t.Errorf("stdout %q, want %q", stdout.String(), tt.wantStdout)
			}
			if !strings.Contains(stderr.String(), tt.wantStderr) {
				t.Errorf("stderr %q, want it to contain %q", stderr.String(), tt.wantStderr)
			}
		})
	}
	b, err := os.ReadFile(out)
	if err != nil || !strings.HasPrefix(string(b), "# Effective configuration of kube-portal-proxy dev (--write-config-to).\n") {
		t.Errorf("written config = %q, %v; want the header with the version", b, err)
	}
}

// TestObserveHelp: `observe --help` prints the subcommand's flags on stdout and exits 0.
func TestObserveHelp(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"observe", "--help"}, &stdout, &stderr); code != 0 {
		t.Errorf("exit code %d, want 0 (stderr %q)", code, stderr.String())
	}
	for _, want := range []string{"Usage of kube-portal-proxy observe:", "--follow", "--all-nodes", "--not-service"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
		}
	}
}
