package config

// manifestjson.go: the services file's YAML to the API types, in one YAML parse and one JSON
// decode. sigs.k8s.io/yaml's YAMLToJSON parses into generic maps, copies them into maps with
// string keys and marshals those through reflection, and the API machinery's universal decoder
// then scans the JSON once to find the kind before decoding it: at 10,000 Services and their
// EndpointSlices that was most of a cold start's CPU besides the YAML parser itself. Here the
// parse keeps the document's key order (yaml.MapSlice), the JSON is written straight from it, the
// kind is read from the parsed top level, and the three kinds the proxy reads are decoded as the
// JSON serializer decodes them (case-sensitive, integers kept). Anything else, and every
// document this path cannot take, goes the old way, so its errors stay those of the API machinery.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"unicode/utf8"

	yaml "go.yaml.in/yaml/v2"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	sigsjson "sigs.k8s.io/json"
	sigsyaml "sigs.k8s.io/yaml"
)

// manifestJSON converts one YAML document to JSON and returns its top-level apiVersion and kind
// ("" when absent or not strings). js is nil for an empty document. The common shape is
// converted by p, into its buffer: js is good until p's next use.
func manifestJSON(p *fastParser, body []byte) (js []byte, apiVersion, kind string, err error) {
	if js, apiVersion, kind, ok := p.convert(body); ok {
		return js, apiVersion, kind, nil
	}
	return parsedManifestJSON(body)
}

// parsedManifestJSON is manifestJSON through the YAML parser.
func parsedManifestJSON(body []byte) (js []byte, apiVersion, kind string, err error) {
	if !startsAsMapping(body) {
		// A sequence would decode into the MapSlice (a slice) without a type error, a list of
		// {key: ..., value: ...} mappings even as an object; tags, anchors and directives are
		// left to the old path too.
		js, err := sigsyaml.YAMLToJSON(body)
		if err == nil && bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
			return nil, "", "", nil // an empty document with an anchor or a tag ("&a", "!!null")
		}
		return js, "", "", err
	}
	var doc yaml.MapSlice
	if err := yaml.Unmarshal(body, &doc); err != nil {
		var te *yaml.TypeError
		if !errors.As(err, &te) {
			return nil, "", "", err // a syntax error: the same parser, so the same message
		}
		// Not a mapping at the top (a scalar or a list): sigs.k8s.io/yaml's JSON, for the API
		// machinery to reject as it always did.
		js, err := sigsyaml.YAMLToJSON(body)
		return js, "", "", err
	}
	if doc == nil {
		if t := firstToken(body); len(t) > 0 && t[0] == '{' {
			return []byte("{}"), "", "", nil // an empty mapping, not an empty document: no kind
		}
		return nil, "", "", nil
	}
	for _, it := range doc {
		switch it.Key {
		case "apiVersion":
			apiVersion, _ = it.Value.(string)
		case "kind":
			kind, _ = it.Value.(string)
		}
	}
	js, err = appendJSON(make([]byte, 0, len(body)+len(body)/2), doc)
	if errors.Is(err, errDuplicateKey) {
		// Rare in real files: sigs.k8s.io/yaml's JSON (the last value of a key wins), and the
		// API machinery finds the kind itself.
		js, err := sigsyaml.YAMLToJSON(body)
		return js, "", "", err
	}
	return js, apiVersion, kind, err
}

// errDuplicateKey: a mapping of the document has a key twice (after the conversion to JSON
// keys: 0 and "0" are the same key).
var errDuplicateKey = errors.New("a mapping has a key twice")

// firstToken is the rest of the line where a document's first token starts (after blank and
// comment lines), nil for none.
func firstToken(body []byte) []byte {
	for line := range bytes.SplitSeq(body, []byte("\n")) {
		if t := bytes.TrimLeft(line, " \t\r"); len(t) > 0 && t[0] != '#' {
			return t
		}
	}
	return nil
}

// startsAsMapping reports whether a document's first token can only start a mapping or a scalar:
// not a block sequence entry ("- "), a flow sequence ("["), a tag, anchor, alias, directive or
// block scalar.
func startsAsMapping(body []byte) bool {
	t := firstToken(body)
	if len(t) == 0 {
		return true // empty: the parser says so
	}
	switch t[0] {
	case '[', '!', '&', '*', '%', '|', '>':
		return false
	case '-':
		return len(t) > 1 && t[1] != ' ' && t[1] != '\t' && t[1] != '\r'
	}
	return true
}

// decodeKnown decodes a Service, an EndpointSlice or a List, or returns nil for anything else.
func decodeKnown(js []byte, apiVersion, kind string) (apiruntime.Object, error) {
	var obj apiruntime.Object
	switch {
	case apiVersion == "v1" && kind == "Service":
		obj = &v1.Service{}
	case apiVersion == "discovery.k8s.io/v1" && kind == "EndpointSlice":
		obj = &discovery.EndpointSlice{}
	case apiVersion == "v1" && kind == "List":
		obj = &v1.List{}
	default:
		return nil, nil
	}
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(js, obj); err != nil {
		return nil, err
	}
	return obj, nil
}

// appendJSON writes a value of the YAML parser as JSON, map keys converted to strings as
// sigs.k8s.io/yaml converts them.
func appendJSON(b []byte, v any) ([]byte, error) {
	switch v := v.(type) {
	case nil:
		return append(b, "null"...), nil
	case string:
		return appendJSONString(b, v), nil
	case bool:
		return strconv.AppendBool(b, v), nil
	case int:
		return strconv.AppendInt(b, int64(v), 10), nil
	case int64:
		return strconv.AppendInt(b, v, 10), nil
	case uint64:
		return strconv.AppendUint(b, v, 10), nil
	case float64:
		if math.IsInf(v, 0) || math.IsNaN(v) {
			return nil, fmt.Errorf("json: unsupported value: %v", v)
		}
		return strconv.AppendFloat(b, v, 'g', -1, 64), nil
	case []any:
		return appendJSONArray(b, v)
	case yaml.MapSlice:
		return appendJSONObject(b, v)
	case map[any]any: // not made when parsing into a MapSlice; sorted, as json.Marshal sorts
		return appendJSONMap(b, v)
	default: // whatever else the parser makes, as encoding/json writes it
		js, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		return append(b, js...), nil
	}
}

// jsonKey is a YAML map key as a JSON object key (sigs.k8s.io/yaml's conversion, and its error,
// which names the value too).
func jsonKey(k, v any) (string, error) {
	switch k := k.(type) {
	case string:
		return k, nil
	case int:
		return strconv.Itoa(k), nil
	case int64:
		return strconv.FormatInt(k, 10), nil
	case float64:
		switch s := strconv.FormatFloat(k, 'g', -1, 32); s {
		case "+Inf":
			return ".inf", nil
		case "-Inf":
			return "-.inf", nil
		case "NaN":
			return ".nan", nil
		default:
			return s, nil
		}
	case bool:
		return strconv.FormatBool(k), nil
	default:
		return "", fmt.Errorf("unsupported map key of type: %s, key: %+#v, value: %+#v", reflect.TypeOf(k), k, v)
	}
}

// appendJSONArray writes a sequence.
func appendJSONArray(b []byte, v []any) ([]byte, error) {
	var err error
	b = append(b, '[')
	for i, e := range v {
		if i > 0 {
			b = append(b, ',')
		}
		if b, err = appendJSON(b, e); err != nil {
			return nil, err
		}
	}
	return append(b, ']'), nil
}

// appendJSONObject writes a mapping in its order. A key twice in a mapping: the API machinery's
// maps keep the last value, where a JSON object with the key twice is read differently by its
// decoders (kind sniffing kept the first): errDuplicateKey sends the document down the old path.
func appendJSONObject(b []byte, v yaml.MapSlice) ([]byte, error) {
	var small [16]string
	var seen map[string]struct{}
	b = append(b, '{')
	for i, it := range v {
		if i > 0 {
			b = append(b, ',')
		}
		key, err := jsonKey(it.Key, it.Value)
		if err != nil {
			return nil, err
		}
		if i < len(small) {
			for _, k := range small[:i] {
				if k == key {
					return nil, errDuplicateKey
				}
			}
			small[i] = key
		} else {
			if seen == nil {
				seen = make(map[string]struct{}, len(v))
				for _, k := range small {
					seen[k] = struct{}{}
				}
			}
			if _, dup := seen[key]; dup {
				return nil, errDuplicateKey
			}
			seen[key] = struct{}{}
		}
		b = append(appendJSONString(b, key), ':')
		if b, err = appendJSON(b, it.Value); err != nil {
			return nil, err
		}
	}
	return append(b, '}'), nil
}

// appendJSONMap writes a map sorted by key, as json.Marshal sorts.
func appendJSONMap(b []byte, v map[any]any) ([]byte, error) {
	keys := make([]string, 0, len(v))
	byKey := make(map[string]any, len(v))
	for k, e := range v {
		key, err := jsonKey(k, e)
		if err != nil {
			return nil, err
		}
		keys = append(keys, key)
		byKey[key] = e
	}
	slices.Sort(keys)
	ms := make(yaml.MapSlice, len(keys))
	for i, k := range keys {
		ms[i] = yaml.MapItem{Key: k, Value: byKey[k]}
	}
	return appendJSONObject(b, ms)
}

// appendJSONString quotes s as encoding/json does, invalid UTF-8 replaced by U+FFFD (HTML
// characters are not escaped: the JSON is only decoded again).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
