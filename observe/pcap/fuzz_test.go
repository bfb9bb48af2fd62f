package pcap

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"testing"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// FuzzWriteItems: whatever a proxy's stream says (lines of items, as observe --pcap reads
// them), the writer never panics, and the file it writes stays within its caps.
func FuzzWriteItems(f *testing.F) {
	f.Add([]byte(`{"flow":{"time":"2026-11-27T18:00:00Z","id":1,"phase":"dial","protocol":"TCP","client":"10.0.0.1:4000","service_address":"10.96.0.10:80","source":"10.244.0.1:5000","endpoint":"10.244.1.1:8080"}}
{"payload":{"id":1,"time":"2026-11-27T18:00:00.1Z","direction":"to-endpoint","data":"R0VUIC8gSFRUUC8xLjENCg=="}}
{"payload":{"id":1,"time":"2026-11-27T18:00:00.2Z","direction":"to-client","data":"SFRUUC8xLjEgMjAwIE9LDQo=","truncated":true}}
{"flow":{"time":"2026-11-27T18:00:01Z","id":1,"phase":"end","protocol":"TCP","client":"10.0.0.1:4000","service_address":"10.96.0.10:80","end_reason":"client-reset","verdict":"reset"}}
`))
	f.Add([]byte(`{"flow":{"id":2,"phase":"start","protocol":"UDP","client":"[fd00::1]:53","service_address":"[fd00::10]:53"}}
{"payload":{"id":2,"direction":"to-client","data":""}}
{"payload":{"id":3,"direction":"sideways","data":"AA=="}}
{"flow":{"id":2,"phase":"end","protocol":"UDP","client":"::ffff:10.0.0.1:1","duration_us":-5}}
`))
	f.Fuzz(func(t *testing.T, stream []byte) {
		var out bytes.Buffer
		w := NewWriter(&out, Options{MaxBytes: 1 << 20, MaxFlowBytes: 4096, PendingBytes: 8192, MaxFlows: 16})
		sc := bufio.NewScanner(bytes.NewReader(stream))
		for sc.Scan() {
			var it observe.Item
			if json.Unmarshal(sc.Bytes(), &it) != nil {
				continue
			}
			if err := w.WriteItem(&it); err != nil {
				t.Fatalf("WriteItem into memory: %v", err)
			}
		}
		if err := w.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		if st := w.Stats(); int64(out.Len()) != st.Bytes || st.Bytes > 1<<20+64<<10 {
			t.Fatalf("file of %d bytes, Stats.Bytes %d, cap 1 MiB", out.Len(), st.Bytes)
		}
		_, _ = io.Copy(io.Discard, &out)
	})
}
