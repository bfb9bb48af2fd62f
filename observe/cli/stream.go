package cli

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kube-portal-proxy/kube-portal-proxy/observe"
)

// item is one line of a stream, parsed, with the line as it came (json output prints it verbatim).
type item struct {
	observe.Item
	raw  []byte
	src  int    // the target's index
	node string // the target's node ("" for --address)
}

// time orders items across streams.
func (it *item) time() time.Time {
	switch {
	case it.Flow != nil:
		return it.Flow.Time
	case it.Lost != nil:
		return it.Lost.Time
	case it.Payload != nil:
		return it.Payload.Time
	}
	return time.Time{}
}

// event is what a stream's reader hands the merging loop: an item, or the end of its stream.
type event struct {
	item
	done bool
	err  error
}

// readStream GETs t's stream and sends its items to out until it ends, fails or ctx is done.
func readStream(ctx context.Context, src int, t target, out chan<- event) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, t.url, nil)
	if err != nil {
		return fmt.Errorf("%s: %w", t.name(), err)
	}
	req.Header.Set("Accept", "application/x-ndjson")
	resp, err := t.client.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", t.name(), err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("%s: GET %s: %s: %s", t.name(), t.url, resp.Status, strings.TrimSpace(string(msg)))
	}
	// Lines may carry captured payload: read whole lines of any length, not a Scanner's 64 KiB.
	r := bufio.NewReaderSize(resp.Body, 64<<10)
	for n := 1; ; n++ {
		line, err := r.ReadBytes('\n')
		if line = bytes.TrimSpace(line); len(line) > 0 {
			it := item{raw: line, src: src, node: t.node}
			if jerr := json.Unmarshal(line, &it.Item); jerr != nil {
				return fmt.Errorf("%s: line %d: %w", t.name(), n, jerr)
			}
			select {
			case out <- event{item: it}:
			case <-ctx.Done():
				return nil
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("%s: read: %w", t.name(), err)
		}
	}
}
