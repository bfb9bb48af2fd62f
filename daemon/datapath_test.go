package daemon

import (
	"strings"
	"testing"
)

// TestDefaultDataPath: --default-data-path and the config file's defaultDataPath, their errors,
// and the refusal of the kernel path in bind mode.
func TestDefaultDataPath(t *testing.T) {
	const head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	tests := []struct {
		name    string
		file    string // "" for no --config
		args    []string
		want    string
		wantErr string
	}{
		{name: "default_is_proxy", want: "proxy"},
		{name: "flag", args: []string{"--default-data-path=kernel"}, want: "kernel"},
		{name: "file", file: head + "defaultDataPath: kernel\n", want: "kernel"},
		{name: "flag_overrides_file", file: head + "defaultDataPath: kernel\n", args: []string{"--default-data-path=proxy"}, want: "proxy"},
		{name: "bad_flag", args: []string{"--default-data-path=fast"}, wantErr: "--default-data-path"},
		{name: "bad_file_value", file: head + "defaultDataPath: fast\n", wantErr: "defaultDataPath: want kernel or proxy"},
		{name: "kernel_needs_iptables_mode", args: []string{"--default-data-path=kernel", "--portal-mode=bind"},
			wantErr: "kernel needs --portal-mode=iptables"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := tt.args
			if tt.file != "" {
				args = append([]string{"--config=" + writeTemp(t, "config.yaml", tt.file)}, args...)
			}
			o, _, err := parseOptions(args)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseOptions(%v) error %v, want one containing %q", args, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.defaultDataPath != tt.want {
				t.Errorf("default data path %q, want %q", o.defaultDataPath, tt.want)
			}
		})
	}
	t.Run("written_config_reads_back", func(t *testing.T) {
		o, _, err := parseOptions([]string{"--default-data-path=kernel"})
		if err != nil {
			t.Fatal(err)
		}
		data, err := marshalConfig(o)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(data), "defaultDataPath: kernel") {
			t.Errorf("written config lacks defaultDataPath:\n%s", data)
		}
		back, _, err := parseOptions([]string{"--config=" + writeTemp(t, "back.yaml", string(data))})
		if err != nil || back.defaultDataPath != "kernel" {
			t.Errorf("read back: %q, %v", back.defaultDataPath, err)
		}
	})
}
