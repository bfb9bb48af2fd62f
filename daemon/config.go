package daemon

// config.go reads kube-proxy's configuration file (--config, a KubeProxyConfiguration of
// kubeproxy.config.k8s.io/v1alpha1) onto the options, and writes the effective configuration back
// in the same format (--write-config-to), so a kube-proxy DaemonSet's ConfigMap carries over.

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	kubeproxyconfig "k8s.io/kube-proxy/config/v1alpha1"
	"k8s.io/utils/ptr"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/kube-portal-proxy/kube-portal-proxy/service"
	"github.com/kube-portal-proxy/kube-portal-proxy/tcp"
)

const (
	configKind = "KubeProxyConfiguration"

	// modeUserspace is the one proxy mode this proxy implements.
	modeUserspace = "userspace"

	// fieldUDPIdleTimeout is the userspace mode's UDP session timeout. It left the published type
	// with the mode (v1.26), but files written for that mode still carry it, so it is read from
	// the raw document.
	fieldUDPIdleTimeout = "udpIdleTimeout"
	// fieldIOEngine is --io-engine: this proxy's own field, next to kube-proxy's.
	fieldIOEngine = "ioEngine"

	// fieldDefaultDataPath is --default-data-path in the file: this proxy's own field beside
	// kube-proxy's type (kernel or proxy), read from the raw document like udpIdleTimeout.
	fieldDefaultDataPath = "defaultDataPath"

	// fieldSourceMode and fieldNodePodCIDR are --source-mode and --node-pod-cidr: this proxy's
	// own fields, read from the raw document like udpIdleTimeout.
	fieldSourceMode  = "sourceMode"
	fieldNodePodCIDR = "nodePodCIDR"

	// fieldMetricsOnlyBindAddress is --metrics-only-bind-address: this proxy's own field, read
	// from the raw document like udpIdleTimeout.
	fieldMetricsOnlyBindAddress = "metricsOnlyBindAddress"

	// fieldFlows configures the live flow stream (the --flow-* flags and --flows-bind-address):
	// this proxy's own object, read from the raw document like udpIdleTimeout.
	fieldFlows = "flows"

	// nodePortPrimary is nodePortAddresses' special value for the Node object's primary IPs.
	nodePortPrimary = "primary"

	// Ports kube-proxy appends to a healthz or metrics address given without one.
	defaultHealthzPort = "10256"
	defaultMetricsPort = "10249"
)

var errNodePortPrimary = errors.New(`"primary" (the Node object's primary IPs) is not supported: ` +
	`list the CIDRs of the node addresses that accept NodePort traffic, or leave it empty for all`)

// proxyConfig is a decoded --config file.
type proxyConfig struct {
	kube kubeproxyconfig.KubeProxyConfiguration
	// udpIdleTimeout is the legacy field; 0 when absent.
	udpIdleTimeout time.Duration
	// ioEngine is fieldIOEngine; empty when absent.
	ioEngine string
	// defaultDataPath is the defaultDataPath field; "" when absent.
	defaultDataPath string
	// sourceMode and nodePodCIDR are fieldSourceMode and fieldNodePodCIDR; "" when absent.
	sourceMode, nodePodCIDR string
	// metricsOnlyBindAddress is fieldMetricsOnlyBindAddress; "" when absent.
	metricsOnlyBindAddress string
	// flows is fieldFlows; its nil fields are absent.
	flows flowsConfig
	// ignored lists the fields that are set but mean nothing here, as dotted paths.
	ignored []string
}

// fileSetting maps one field of the file onto the option of one flag.
type fileSetting struct {
	field string // dotted path in the file
	flag  string
	// set says the file gives a value. As in kube-proxy, a zero value means "default" (kubeadm
	// writes every field, mostly zeros); pointer fields are set when not null.
	set   bool
	apply func(o *Options)
}

// settings lists every field that means something here, in the order of kube-proxy's type.
func (c *proxyConfig) settings() []fileSetting {
	k := &c.kube
	f := &c.flows
	cc := &k.ClientConnection
	ct := &k.Conntrack
	return []fileSetting{
		{"clientConnection.kubeconfig", "kubeconfig", cc.Kubeconfig != "", func(o *Options) { o.kubeconfig = cc.Kubeconfig }},
		{"clientConnection.qps", "kube-api-qps", cc.QPS != 0, func(o *Options) { o.apiQPS = cc.QPS }},
		{"clientConnection.burst", "kube-api-burst", cc.Burst != 0, func(o *Options) { o.apiBurst = int(cc.Burst) }},
		{"logging.format", "log-format", k.Logging.Format != "", func(o *Options) { o.logFormat = k.Logging.Format }},
		{"hostnameOverride", "hostname-override", k.HostnameOverride != "", func(o *Options) { o.hostnameOverride = strings.TrimSpace(k.HostnameOverride) }},
		{"bindAddress", "bind-address", k.BindAddress != "", func(o *Options) { o.bindAddress = k.BindAddress }},
		{"healthzBindAddress", "healthz-bind-address", k.HealthzBindAddress != "", func(o *Options) {
			o.healthzBindAddress = withDefaultPort(k.HealthzBindAddress, defaultHealthzPort)
		}},
		{"metricsBindAddress", "metrics-bind-address", k.MetricsBindAddress != "", func(o *Options) {
			o.metricsBindAddress = withDefaultPort(k.MetricsBindAddress, defaultMetricsPort)
		}},
		{"enableProfiling", "profiling", k.EnableProfiling, func(o *Options) { o.profiling = true }},
		{"iptables.syncPeriod", "iptables-sync-period", k.IPTables.SyncPeriod.Duration != 0, func(o *Options) { o.syncPeriod = k.IPTables.SyncPeriod.Duration }},
		{"iptables.minSyncPeriod", "iptables-min-sync-period", k.IPTables.MinSyncPeriod.Duration != 0, func(o *Options) { o.minSyncPeriod = k.IPTables.MinSyncPeriod.Duration }},
		{"clusterCIDR", "cluster-cidr", k.ClusterCIDR != "", func(o *Options) { o.clusterCIDR = k.ClusterCIDR }},
		{"nodePortAddresses", "nodeport-addresses", len(k.NodePortAddresses) > 0, func(o *Options) { o.nodePortAddresses = slices.Clone(k.NodePortAddresses) }},
		{"oomScoreAdj", "oom-score-adj", k.OOMScoreAdj != nil, func(o *Options) { o.oomScoreAdj = *k.OOMScoreAdj }},
		{"conntrack.maxPerCore", "conntrack-max-per-core", ct.MaxPerCore != nil, func(o *Options) { o.conntrackMaxPerCore = *ct.MaxPerCore }},
		{"conntrack.min", "conntrack-min", ct.Min != nil, func(o *Options) { o.conntrackMin = *ct.Min }},
		{"conntrack.tcpEstablishedTimeout", "conntrack-tcp-timeout-established", ct.TCPEstablishedTimeout != nil, func(o *Options) { o.conntrackTCPEstablished = ct.TCPEstablishedTimeout.Duration }},
		{"conntrack.tcpCloseWaitTimeout", "conntrack-tcp-timeout-close-wait", ct.TCPCloseWaitTimeout != nil, func(o *Options) { o.conntrackTCPCloseWait = ct.TCPCloseWaitTimeout.Duration }},
		{"conntrack.tcpBeLiberal", "conntrack-tcp-be-liberal", ct.TCPBeLiberal, func(o *Options) { o.conntrackTCPBeLiberal = true }},
		{"conntrack.udpTimeout", "conntrack-udp-timeout", ct.UDPTimeout.Duration != 0, func(o *Options) { o.conntrackUDPTimeout = ct.UDPTimeout.Duration }},
		{"conntrack.udpStreamTimeout", "conntrack-udp-timeout-stream", ct.UDPStreamTimeout.Duration != 0, func(o *Options) { o.conntrackUDPStreamTimeout = ct.UDPStreamTimeout.Duration }},
		{"configSyncPeriod", "config-sync-period", k.ConfigSyncPeriod.Duration != 0, func(o *Options) { o.configSyncPeriod = k.ConfigSyncPeriod.Duration }},
		{"portRange", "proxy-port-range", k.PortRange != "", func(o *Options) { o.proxyPortRange = k.PortRange }},
		{fieldUDPIdleTimeout, "udp-timeout", c.udpIdleTimeout != 0, func(o *Options) { o.udpTimeout = c.udpIdleTimeout }},
		{fieldIOEngine, "io-engine", c.ioEngine != "", func(o *Options) { o.ioEngine = c.ioEngine }},
		{fieldDefaultDataPath, "default-data-path", c.defaultDataPath != "", func(o *Options) { o.defaultDataPath = c.defaultDataPath }},
		{fieldSourceMode, "source-mode", c.sourceMode != "", func(o *Options) { o.sourceMode = c.sourceMode }},
		{fieldNodePodCIDR, "node-pod-cidr", c.nodePodCIDR != "", func(o *Options) { o.nodePodCIDR = c.nodePodCIDR }},
		{fieldMetricsOnlyBindAddress, "metrics-only-bind-address", c.metricsOnlyBindAddress != "", func(o *Options) { o.metricsOnlyBindAddress = c.metricsOnlyBindAddress }},
		{fieldFlows + ".ringSize", "flow-ring-size", f.RingSize != nil, func(o *Options) { o.flows.ringSize = *f.RingSize }},
		{fieldFlows + ".maxObservers", "flow-max-observers", f.MaxObservers != nil, func(o *Options) { o.flows.maxObservers = *f.MaxObservers }},
		{fieldFlows + ".maxRate", "flow-max-rate", f.MaxRate != nil, func(o *Options) { o.flows.maxRate = *f.MaxRate }},
		{fieldFlows + ".capture", "flow-capture", f.Capture != nil, func(o *Options) { o.flows.capture = *f.Capture }},
		{fieldFlows + ".captureBytes", "flow-capture-bytes", f.CaptureBytes != nil, func(o *Options) { o.flows.captureBytes = *f.CaptureBytes }},
		{fieldFlows + ".bindAddress", "flows-bind-address", f.BindAddress != nil, func(o *Options) { o.flows.bindAddress = *f.BindAddress }},
	}
}

// flowsConfig is the file's flows object.
type flowsConfig struct {
	RingSize     *int    `json:"ringSize"`
	MaxObservers *int    `json:"maxObservers"`
	MaxRate      *int    `json:"maxRate"`
	Capture      *bool   `json:"capture"`
	CaptureBytes *int    `json:"captureBytes"`
	BindAddress  *string `json:"bindAddress"`
}

// decodeFlows decodes the flows object strictly: an unknown field or a value of the wrong type
// is an error naming it.
func decodeFlows(v any) (flowsConfig, error) {
	var f flowsConfig
	js, err := json.Marshal(v)
	if err != nil {
		return f, fmt.Errorf("%s: %w", fieldFlows, err)
	}
	strict, err := kjson.UnmarshalStrict(js, &f, kjson.DisallowUnknownFields)
	if err == nil && len(strict) > 0 {
		err = strict[0]
	}
	if err != nil {
		return f, fmt.Errorf("%s: want an object with ringSize, maxObservers, maxRate, captureBytes (integers), capture (a boolean), bindAddress (ip:port): %w", fieldFlows, err)
	}
	return f, nil
}

// honoured are fields without an option that this proxy nevertheless does: listen failures of the
// healthz and metrics servers are always fatal.
var honoured = map[string]bool{"bindAddressHardFail": true, "mode": true}

// loadConfigFile applies --config to o, except for the flags given explicitly (fs.Changed),
// which override the file as in kube-proxy.
func (o *Options) loadConfigFile(fs *pflag.FlagSet) error {
	data, err := os.ReadFile(o.configFile)
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	c, err := decodeProxyConfig(data)
	if err != nil {
		return fmt.Errorf("--config %s: %w", o.configFile, err)
	}
	o.applyConfig(c, fs)
	return nil
}

// applyConfig copies the file's settings into o, skipping flags set on the command line.
func (o *Options) applyConfig(c *proxyConfig, fs *pflag.FlagSet) {
	o.configFields = map[string]string{}
	for _, s := range c.settings() {
		if !s.set || fs.Changed(s.flag) {
			continue
		}
		s.apply(o)
		o.configFields[s.flag] = s.field
	}
	o.configIgnored = c.ignored
	if _, ok := o.configFields["udp-timeout"]; ok && c.udpIdleTimeout < time.Second {
		o.configWarnings = append(o.configWarnings, fmt.Sprintf("%s %v (the legacy default was 250ms) ends UDP sessions before a resolver retries: consider 10s or more",
			fieldUDPIdleTimeout, c.udpIdleTimeout))
	}
}

// setting names a flag in errors: the flag itself, or the --config field that gave its value.
func (o *Options) setting(flag string) string {
	if field, ok := o.configFields[strings.TrimPrefix(flag, "--")]; ok {
		return fmt.Sprintf("%s (field %s of --config %s)", flag, field, o.configFile)
	}
	return flag
}

// decodeProxyConfig decodes a KubeProxyConfiguration strictly: unknown or duplicate fields and
// values of the wrong type are errors that name the field. A mode other than userspace is refused.
func decodeProxyConfig(data []byte) (*proxyConfig, error) {
	raw, err := decodeMapping(data)
	if err != nil {
		return nil, err
	}
	c := &proxyConfig{}
	if err := c.takeOwnFields(raw); err != nil {
		return nil, err
	}
	if err := c.decodeKube(raw); err != nil {
		return nil, err
	}
	return c, nil
}

// decodeMapping decodes strict YAML (no duplicate field) into a mapping whose apiVersion and kind
// are a KubeProxyConfiguration's.
func decodeMapping(data []byte) (map[string]any, error) {
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, fmt.Errorf("not valid YAML: %w", err)
	}
	var raw map[string]any
	if err := json.Unmarshal(js, &raw); err != nil || raw == nil {
		return nil, errors.New("want a YAML mapping with apiVersion: kubeproxy.config.k8s.io/v1alpha1 and kind: KubeProxyConfiguration")
	}
	if err := checkTypeMeta(raw); err != nil {
		return nil, err
	}
	return raw, nil
}

// takeOwnFields decodes the fields kube-portal-proxy adds to a KubeProxyConfiguration and removes
// them from raw, leaving kube-proxy's own for the strict decoder.
func (c *proxyConfig) takeOwnFields(raw map[string]any) error {
	fields := []struct {
		name   string
		decode func(v any) error
	}{
		{fieldUDPIdleTimeout, func(v any) (err error) {
			c.udpIdleTimeout, err = parseDurationField(fieldUDPIdleTimeout, v)
			return err
		}},
		{fieldIOEngine, func(v any) error {
			s, isString := v.(string)
			if !isString {
				return fmt.Errorf("%s: want a string (%s), got %v", fieldIOEngine, strings.Join(tcp.EngineNames, ", "), v)
			}
			c.ioEngine = s
			return nil
		}},
		{fieldDefaultDataPath, func(v any) error {
			s, _ := v.(string)
			if s != "kernel" && s != "proxy" {
				return fmt.Errorf("%s: want kernel or proxy, got %v", fieldDefaultDataPath, v)
			}
			c.defaultDataPath = s
			return nil
		}},
		{fieldSourceMode, func(v any) error {
			s, _ := v.(string)
			if s != string(service.SourceAuto) && s != string(service.SourceProxy) && s != string(service.SourceTransparent) {
				return fmt.Errorf("%s: want auto, proxy or transparent, got %v", fieldSourceMode, v)
			}
			c.sourceMode = s
			return nil
		}},
		{fieldNodePodCIDR, func(v any) error {
			s, isString := v.(string)
			if !isString {
				return fmt.Errorf("%s: want a string of comma-separated CIDRs, got %v", fieldNodePodCIDR, v)
			}
			c.nodePodCIDR = s
			return nil
		}},
		{fieldMetricsOnlyBindAddress, func(v any) error {
			s, isString := v.(string)
			if !isString {
				return fmt.Errorf("%s: want an ip:port string, got %v", fieldMetricsOnlyBindAddress, v)
			}
			c.metricsOnlyBindAddress = s
			return nil
		}},
		{fieldFlows, func(v any) (err error) {
			c.flows, err = decodeFlows(v)
			return err
		}},
	}
	for _, f := range fields {
		v, ok := raw[f.name]
		if !ok {
			continue
		}
		if err := f.decode(v); err != nil {
			return err
		}
		delete(raw, f.name)
	}
	return nil
}

// decodeKube decodes kube-proxy's fields strictly (durations checked first, so that an error
// names the field), refuses a mode other than userspace, and notes the fields this proxy ignores.
func (c *proxyConfig) decodeKube(raw map[string]any) error {
	configType := reflect.TypeFor[kubeproxyconfig.KubeProxyConfiguration]()
	if err := visitFields(raw, configType, "", checkDuration); err != nil {
		return err
	}
	js, err := json.Marshal(raw)
	if err != nil {
		return err
	}
	if _, _, err := configCodecs.UniversalDeserializer().Decode(js, nil, &c.kube); err != nil {
		return err
	}
	if m := c.kube.Mode; m != "" && m != modeUserspace {
		return fmt.Errorf("mode %q: kube-portal-proxy is kube-proxy's userspace (portal) mode and only that: set mode: %s or leave it empty, or keep kube-proxy for the %s mode",
			m, modeUserspace, m)
	}
	if slices.ContainsFunc(c.kube.NodePortAddresses, func(s string) bool { return strings.TrimSpace(s) == nodePortPrimary }) {
		return fmt.Errorf("nodePortAddresses: %w", errNodePortPrimary)
	}
	c.ignored = c.ignoredFields(raw, configType)
	return nil
}

// configCodecs decodes strictly: an unknown field is an error naming it.
var configCodecs = func() serializer.CodecFactory {
	scheme := runtime.NewScheme()
	if err := kubeproxyconfig.AddToScheme(scheme); err != nil {
		panic(err) // registering a static type cannot fail
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict)
}()

func checkTypeMeta(raw map[string]any) error {
	want := map[string]string{"apiVersion": kubeproxyconfig.SchemeGroupVersion.String(), "kind": configKind}
	for _, field := range []string{"apiVersion", "kind"} {
		v, ok := raw[field]
		if !ok {
			return fmt.Errorf("%s missing: want %s", field, want[field])
		}
		if got, _ := v.(string); got != want[field] {
			return fmt.Errorf("%s %q: want %s", field, fmt.Sprint(v), want[field])
		}
	}
	return nil
}

// ignoredFields lists the fields of raw that carry a value but have no effect here.
func (c *proxyConfig) ignoredFields(raw map[string]any, t reflect.Type) []string {
	used := map[string]bool{"apiVersion": true, "kind": true}
	for _, s := range c.settings() {
		used[s.field] = true
	}
	var out []string
	_ = visitFields(raw, t, "", func(path string, t reflect.Type, v any) error {
		if !used[path] && !honoured[path] && meaningful(t, v) {
			out = append(out, path)
		}
		return nil
	})
	return out
}

var (
	durationType      = reflect.TypeFor[metav1.Duration]()
	jsonUnmarshalType = reflect.TypeFor[json.Unmarshaler]()
)

// visitFields calls visit for every leaf field present in raw (the file as JSON), in sorted order,
// with its dotted path and Go type; it descends into nested structs. Keys that are not fields of t
// are skipped: the strict decoder reports them.
func visitFields(raw map[string]any, t reflect.Type, prefix string, visit func(path string, t reflect.Type, v any) error) error {
	fields := jsonFields(t)
	keys := make([]string, 0, len(raw))
	for k := range raw {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		ft, ok := fields[k]
		if !ok {
			continue
		}
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		sub, isObject := raw[k].(map[string]any)
		// Structs with their own JSON form (durations, quantities) are leaves.
		if isObject && ft.Kind() == reflect.Struct && !reflect.PointerTo(ft).Implements(jsonUnmarshalType) {
			if err := visitFields(sub, ft, prefix+k+".", visit); err != nil {
				return err
			}
			continue
		}
		if err := visit(prefix+k, ft, raw[k]); err != nil {
			return err
		}
	}
	return nil
}

// jsonFields maps the JSON names of t's fields to their types, merging inlined structs.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-":
		case f.Anonymous && name == "":
			for k, v := range jsonFields(f.Type) {
				out[k] = v
			}
		case f.IsExported():
			if name == "" {
				name = f.Name
			}
			out[name] = f.Type
		}
	}
	return out
}

// checkDuration names the field of a malformed duration, which the decoder would not.
func checkDuration(path string, t reflect.Type, v any) error {
	if t != durationType || v == nil {
		return nil
	}
	_, err := parseDurationField(path, v)
	return err
}

func parseDurationField(path string, v any) (time.Duration, error) {
	s, ok := v.(string)
	if !ok {
		return 0, fmt.Errorf("%s: want a duration such as \"30s\", got %v", path, v)
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return d, nil
}

// meaningful reports whether a field's value differs from "unset": kubeadm writes every field,
// with zeros, nulls and empty strings for the defaults.
func meaningful(t reflect.Type, v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case float64:
		return x != 0
	case string:
		if t == durationType {
			d, _ := time.ParseDuration(x)
			return d != 0
		}
		return x != "" && x != "0"
	case []any:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return true
}

// withDefaultPort appends kube-proxy's default port to a bare IP, as kube-proxy does.
func withDefaultPort(addr, port string) string {
	if ip, err := netip.ParseAddr(strings.Trim(addr, "[]")); err == nil {
		return net.JoinHostPort(ip.String(), port)
	}
	return addr
}

// logConfigNotes reports once, at startup, what --config set that this proxy ignores, and
// values worth a second look.
func logConfigNotes(log logrus.FieldLogger, o *Options) {
	if len(o.configIgnored) > 0 {
		log.WithFields(logrus.Fields{"config": o.configFile, "fields": strings.Join(o.configIgnored, ",")}).
			Info("Ignoring configuration fields that mean nothing to the userspace proxy")
	}
	for _, w := range o.configWarnings {
		log.WithField("config", o.configFile).Warn(w)
	}
}

// WriteConfig writes the effective configuration to --write-config-to; version goes in its
// header.
func (o *Options) WriteConfig(version string) error {
	data, err := encodeConfig(o, o.flags, version)
	if err != nil {
		return fmt.Errorf("--write-config-to: %w", err)
	}
	if err := os.WriteFile(o.writeConfigTo, data, 0o644); err != nil {
		return fmt.Errorf("--write-config-to: %w", err)
	}
	return nil
}

// encodeConfig renders the effective options as a KubeProxyConfiguration this proxy reads back
// to the same options. A header comment lists, as flags, what the file cannot carry: settings
// kube-proxy has no field for, and values kube-proxy reads as "default" (such as an empty
// healthzBindAddress, which disables the server here).
func encodeConfig(o *Options, fs *pflag.FlagSet, version string) ([]byte, error) {
	body, err := marshalConfig(o)
	if err != nil {
		return nil, err
	}
	back, err := decodeProxyConfig(body)
	if err != nil {
		return nil, fmt.Errorf("the effective configuration does not read back: %w", err)
	}
	fields := map[string]bool{}
	for _, s := range back.settings() {
		fields[s.flag] = true
	}
	// What the file alone gives: defaults, then the file's settings.
	fromFile := &Options{}
	fileFlags := newFlagSet(fromFile)
	fromFile.applyConfig(back, fileFlags)

	var extra []string
	fs.VisitAll(func(f *pflag.Flag) {
		switch f.Name {
		case "config", "write-config-to", "cleanup", "version":
			return
		}
		want := flagValue(f)
		if fields[f.Name] {
			if got := flagValue(fileFlags.Lookup(f.Name)); got == want {
				return
			}
		} else if f.DefValue == f.Value.String() {
			return
		}
		extra = append(extra, "--"+f.Name+"="+shellQuote(want))
	})

	var b strings.Builder
	fmt.Fprintf(&b, "# Effective configuration of kube-portal-proxy %s (--write-config-to).\n", version)
	if len(extra) > 0 {
		b.WriteString("# Not expressible in this file; pass these flags next to --config:\n")
		for _, e := range extra {
			fmt.Fprintf(&b, "#   %s\n", e)
		}
	}
	b.Write(body)
	return []byte(b.String()), nil
}

// marshalConfig renders the options' KubeProxyConfiguration, plus the legacy udpIdleTimeout.
func marshalConfig(o *Options) ([]byte, error) {
	js, err := json.Marshal(o.kubeProxyConfiguration())
	if err != nil {
		return nil, err
	}
	var doc map[string]any
	if err := json.Unmarshal(js, &doc); err != nil {
		return nil, err
	}
	doc[fieldUDPIdleTimeout] = o.udpTimeout.String()
	doc[fieldIOEngine] = o.ioEngine
	if o.defaultDataPath != "" && o.defaultDataPath != "proxy" {
		doc[fieldDefaultDataPath] = o.defaultDataPath
	}
	if o.sourceMode != "" && o.sourceMode != string(service.SourceAuto) {
		doc[fieldSourceMode] = o.sourceMode
	}
	if o.nodePodCIDR != "" {
		doc[fieldNodePodCIDR] = o.nodePodCIDR
	}
	if o.metricsOnlyBindAddress != "" {
		doc[fieldMetricsOnlyBindAddress] = o.metricsOnlyBindAddress
	}
	if o.flows != defaultFlowOptions() {
		f := o.flows
		doc[fieldFlows] = flowsConfig{RingSize: &f.ringSize, MaxObservers: &f.maxObservers, MaxRate: &f.maxRate,
			Capture: &f.capture, CaptureBytes: &f.captureBytes, BindAddress: &f.bindAddress}
	}
	return yaml.Marshal(doc)
}

// kubeProxyConfiguration is the options as kube-proxy's configuration type.
func (o *Options) kubeProxyConfiguration() *kubeproxyconfig.KubeProxyConfiguration {
	dur := func(d time.Duration) metav1.Duration { return metav1.Duration{Duration: d} }
	c := &kubeproxyconfig.KubeProxyConfiguration{
		TypeMeta:           metav1.TypeMeta{APIVersion: kubeproxyconfig.SchemeGroupVersion.String(), Kind: configKind},
		HostnameOverride:   o.hostnameOverride,
		BindAddress:        o.bindAddress,
		HealthzBindAddress: o.healthzBindAddress,
		MetricsBindAddress: o.metricsBindAddress,
		EnableProfiling:    o.profiling,
		Mode:               modeUserspace,
		NodePortAddresses:  slices.Clone(o.nodePortAddresses),
		ClusterCIDR:        o.clusterCIDR,
		OOMScoreAdj:        ptr.To(o.oomScoreAdj),
		ConfigSyncPeriod:   dur(o.configSyncPeriod),
		PortRange:          o.proxyPortRange,
	}
	c.ClientConnection.Kubeconfig = o.kubeconfig
	c.ClientConnection.QPS = o.apiQPS
	c.ClientConnection.Burst = int32(o.apiBurst)
	c.Logging.Format = o.logFormat
	c.IPTables.SyncPeriod = dur(o.syncPeriod)
	c.IPTables.MinSyncPeriod = dur(o.minSyncPeriod)
	established, closeWait := dur(o.conntrackTCPEstablished), dur(o.conntrackTCPCloseWait)
	c.Conntrack = kubeproxyconfig.KubeProxyConntrackConfiguration{
		MaxPerCore:            ptr.To(o.conntrackMaxPerCore),
		Min:                   ptr.To(o.conntrackMin),
		TCPEstablishedTimeout: &established,
		TCPCloseWaitTimeout:   &closeWait,
		TCPBeLiberal:          o.conntrackTCPBeLiberal,
		UDPTimeout:            dur(o.conntrackUDPTimeout),
		UDPStreamTimeout:      dur(o.conntrackUDPStreamTimeout),
	}
	return c
}

// flagValue is a flag's value as it is written on a command line.
func flagValue(f *pflag.Flag) string {
	if s, ok := f.Value.(pflag.SliceValue); ok {
		return strings.Join(s.GetSlice(), ",")
	}
	return f.Value.String()
}

func shellQuote(s string) string {
	if s != "" && !strings.ContainsAny(s, " \t\n'\"\\$`!*?[]{}()<>|&;#~") {
		return s
	}
	return strconv.Quote(s)
}
