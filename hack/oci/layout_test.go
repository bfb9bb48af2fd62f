package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// layout is an OCI image layout tarball read back: its files by name.
type layout map[string][]byte

func readLayout(t *testing.T, data []byte) layout {
	t.Helper()
	l := layout{}
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return l
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			l[h.Name] = b
		}
	}
}

// blob returns the blob a descriptor names, checking its digest and size.
func (l layout) blob(t *testing.T, d Descriptor) []byte {
	t.Helper()
	b, ok := l["blobs/sha256/"+d.Digest[len("sha256:"):]]
	if !ok {
		t.Fatalf("blob %s missing", d.Digest)
	}
	sum := sha256.Sum256(b)
	if got := "sha256:" + hex.EncodeToString(sum[:]); got != d.Digest || int64(len(b)) != d.Size {
		t.Fatalf("blob %s: digest %s size %d, descriptor says size %d", d.Digest, got, len(b), d.Size)
	}
	return b
}

type entry struct {
	Type     byte
	Mode     int64
	Linkname string
	Body     string
}

func tarEntries(t *testing.T, data []byte) map[string]entry {
	t.Helper()
	out := map[string]entry{}
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		out[h.Name] = entry{h.Typeflag, h.Mode, h.Linkname, string(b)}
	}
}

func baseTar(t *testing.T) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "./etc/os-release", Size: 5, Mode: 0o644}); err != nil {
		t.Fatal(err)
	}
	tw.Write([]byte("base\n"))
	tw.Close()
	p := filepath.Join(t.TempDir(), "rootfs.tar")
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestWriteIsAnImageContainerdImports reads a written layout back the way an importer does:
// index.json names the image for linux/amd64, every descriptor's digest and size match its
// blob, the config lists the layers' digests as diff IDs, the base tar is the first layer as
// is and the second holds the files (mode kept), symlinks and their parent directories.
func TestWriteIsAnImageContainerdImports(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "x")
	if err := os.WriteFile(bin, []byte("#!binary"), 0o755); err != nil {
		t.Fatal(err)
	}
	base := baseTar(t)
	spec := Spec{
		Name:       "example.invalid/x:v1",
		Base:       base,
		Files:      []File{{Src: bin, Path: "/usr/local/bin/x"}},
		Symlinks:   []Symlink{{Path: "/usr/local/bin/y", Target: "x"}},
		Entrypoint: []string{"/usr/local/bin/x"},
		Cmd:        []string{"serve"},
		Env:        []string{DefaultPath},
		User:       "65535:65535",
	}
	var buf bytes.Buffer
	if err := Write(&buf, spec); err != nil {
		t.Fatal(err)
	}
	l := readLayout(t, buf.Bytes())
	if got := string(l["oci-layout"]); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout = %s", got)
	}
	var idx Index
	if err := json.Unmarshal(l["index.json"], &idx); err != nil {
		t.Fatal(err)
	}
	if len(idx.Manifests) != 1 {
		t.Fatalf("index has %d manifests, want 1", len(idx.Manifests))
	}
	d := idx.Manifests[0]
	wantAnn := map[string]string{AnnotationName: "example.invalid/x:v1", AnnotationRefName: "v1"}
	if diff := cmp.Diff(wantAnn, d.Annotations); diff != "" {
		t.Errorf("annotations (-want +got):\n%s", diff)
	}
	if d.Platform == nil || *d.Platform != (Platform{Architecture: "amd64", OS: "linux"}) {
		t.Errorf("platform = %+v, want linux/amd64", d.Platform)
	}
	var m Manifest
	if err := json.Unmarshal(l.blob(t, d), &m); err != nil {
		t.Fatal(err)
	}
	var cfg Config
	if err := json.Unmarshal(l.blob(t, m.Config), &cfg); err != nil {
		t.Fatal(err)
	}
	wantRun := ImageConfig{User: "65535:65535", Env: []string{DefaultPath}, Entrypoint: []string{"/usr/local/bin/x"}, Cmd: []string{"serve"}}
	if diff := cmp.Diff(wantRun, cfg.Config); diff != "" {
		t.Errorf("config (-want +got):\n%s", diff)
	}
	if cfg.OS != "linux" || cfg.Architecture != "amd64" || cfg.RootFS.Type != "layers" {
		t.Errorf("config os/arch/rootfs = %s/%s/%s", cfg.OS, cfg.Architecture, cfg.RootFS.Type)
	}
	if len(m.Layers) != 2 {
		t.Fatalf("%d layers, want base + files", len(m.Layers))
	}
	for i, layer := range m.Layers {
		if layer.MediaType != MediaTypeLayer || cfg.RootFS.DiffIDs[i] != layer.Digest {
			t.Errorf("layer %d: media type %s, digest %s, diff ID %s", i, layer.MediaType, layer.Digest, cfg.RootFS.DiffIDs[i])
		}
	}
	baseData, _ := os.ReadFile(base)
	if !bytes.Equal(l.blob(t, m.Layers[0]), baseData) {
		t.Error("first layer is not the base tar as is")
	}
	want := map[string]entry{
		"usr/":            {Type: tar.TypeDir, Mode: 0o755},
		"usr/local/":      {Type: tar.TypeDir, Mode: 0o755},
		"usr/local/bin/":  {Type: tar.TypeDir, Mode: 0o755},
		"usr/local/bin/x": {Type: tar.TypeReg, Mode: 0o755, Body: "#!binary"},
		"usr/local/bin/y": {Type: tar.TypeSymlink, Mode: 0o777, Linkname: "x"},
	}
	if diff := cmp.Diff(want, tarEntries(t, l.blob(t, m.Layers[1]))); diff != "" {
		t.Errorf("files layer (-want +got):\n%s", diff)
	}

	var again bytes.Buffer
	if err := Write(&again, spec); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf.Bytes(), again.Bytes()) {
		t.Error("two writes of one spec differ: the image is not reproducible")
	}
}

func TestRefName(t *testing.T) {
	for ref, want := range map[string]string{
		"registry.k8s.io/pause:3.10.2": "3.10.2",
		"localhost:5000/x":             "latest",
		"localhost:5000/x:dev":         "dev",
		"ghcr.io/a/b:24f5783-dirty":    "24f5783-dirty",
	} {
		if got := refName(ref); got != want {
			t.Errorf("refName(%q) = %q, want %q", ref, got, want)
		}
	}
}

func TestWriteRefusesRelativeImagePaths(t *testing.T) {
	err := Write(io.Discard, Spec{Name: "x:1", Symlinks: []Symlink{{Path: "usr/bin/x", Target: "y"}}})
	if err == nil {
		t.Error("a relative image path was accepted")
	}
}
