package daemon

import (
	"reflect"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/proxier"
)

func TestParseKernelPorts(t *testing.T) {
	tests := []struct {
		name, rng, reserved string
		want                proxier.KernelPorts
		wantErr             bool
	}{
		{"default", "32768\t60999\n", "\n", proxier.KernelPorts{Range: proxier.PortRange{Base: 32768, Size: 28232}}, false},
		{"reserved_ports_and_ranges", "1024 65535\n", "8080,9000-9010\n", proxier.KernelPorts{Range: proxier.PortRange{Base: 1024, Size: 64512},
			Reserved: []proxier.PortRange{{Base: 8080, Size: 1}, {Base: 9000, Size: 11}}}, false},
		{"garbage", "x\n", "", proxier.KernelPorts{}, true},
		{"inverted", "60999 32768", "", proxier.KernelPorts{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseKernelPorts(tt.rng, tt.reserved)
			if (err != nil) != tt.wantErr || !reflect.DeepEqual(got, tt.want) {
				t.Errorf("parseKernelPorts = %+v, %v; want %+v, error=%v", got, err, tt.want, tt.wantErr)
			}
		})
	}
}
