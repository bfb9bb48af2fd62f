package config

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// TestOneFileSetIsTheFilesCache: the set of a single services file is the file's own parse, not
// a copy of its maps (at 10,000 services the copy was 2 MB of the live heap, kept beside the
// cache until the next load); its objects are all there.
func TestOneFileSetIsTheFilesCache(t *testing.T) {
	p := filepath.Join(t.TempDir(), "web.yaml")
	if err := os.WriteFile(p, []byte(webYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	files, stamps, _, err := listManifests(p)
	if err != nil {
		t.Fatal(err)
	}
	cache := map[string]*parsedFile{}
	set, err := parseManifests(files, stamps, cache)
	if err != nil {
		t.Fatal(err)
	}
	if len(set.services) != 1 || len(set.slices) != 1 || len(set.entries) != 2 {
		t.Fatalf("set of %s: %d services, %d slices, %d entries; want 1, 1, 2",
			p, len(set.services), len(set.slices), len(set.entries))
	}
	same := func(a, b any) bool { return reflect.ValueOf(a).UnsafePointer() == reflect.ValueOf(b).UnsafePointer() }
	if !same(set.entries, cache[p].entries) {
		t.Error("the set of one file holds a copy of the file's map")
	}

	// The file unchanged: nothing decoded again, the same maps.
	set, err = parseManifests(files, stamps, cache)
	if err != nil {
		t.Fatal(err)
	}
	if len(set.services) != 0 || len(set.slices) != 0 || len(set.entries) != 2 || !same(set.entries, cache[p].entries) {
		t.Errorf("unchanged file: %d services and %d slices decoded again, %d entries; want 0, 0, 2 and the cache's map",
			len(set.services), len(set.slices), len(set.entries))
	}
}
