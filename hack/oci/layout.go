package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"
)

// DefaultPath is the PATH of Debian's images (debian:bookworm-slim), the base of the Dockerfile.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Media types and annotations of the OCI image spec and containerd.
const (
	MediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
	MediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	MediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	MediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar"
	AnnotationName    = "io.containerd.image.name"
	AnnotationRefName = "org.opencontainers.image.ref.name"
)

// Spec describes one image.
type Spec struct {
	Name       string // full reference, e.g. registry.k8s.io/pause:3.10.2
	Base       string // root filesystem tar, the first layer; empty for none
	Files      []File
	Symlinks   []Symlink
	Entrypoint []string
	Cmd        []string
	Env        []string
	User       string
	WorkingDir string
}

// File is a local file copied into the image, its mode kept.
type File struct{ Src, Path string }

// Symlink is a symbolic link in the image.
type Symlink struct{ Path, Target string }

// Descriptor is an OCI content descriptor.
type Descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *Platform         `json:"platform,omitempty"`
}

// Platform is an OCI platform.
type Platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

// Manifest is an OCI image manifest.
type Manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        Descriptor   `json:"config"`
	Layers        []Descriptor `json:"layers"`
}

// Index is an OCI image index (index.json).
type Index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []Descriptor `json:"manifests"`
}

// ImageConfig is the runtime part of an OCI image config.
type ImageConfig struct {
	User       string   `json:"User,omitempty"`
	Env        []string `json:"Env,omitempty"`
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
	WorkingDir string   `json:"WorkingDir,omitempty"`
}

// Config is an OCI image config.
type Config struct {
	Created      string      `json:"created"`
	Architecture string      `json:"architecture"`
	OS           string      `json:"os"`
	Config       ImageConfig `json:"config"`
	RootFS       struct {
		Type    string   `json:"type"`
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

// blob is one file under blobs/sha256: either in memory or a local file.
type blob struct {
	digest string
	size   int64
	data   []byte
	file   string
}

func memBlob(data []byte) blob {
	sum := sha256.Sum256(data)
	return blob{digest: "sha256:" + hex.EncodeToString(sum[:]), size: int64(len(data)), data: data}
}

func fileBlob(name string) (blob, error) {
	f, err := os.Open(name)
	if err != nil {
		return blob{}, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return blob{}, fmt.Errorf("reading %s: %w", name, err)
	}
	return blob{digest: "sha256:" + hex.EncodeToString(h.Sum(nil)), size: n, file: name}, nil
}

// Write writes the image spec describes to w as an OCI image layout tar.
func Write(w io.Writer, spec Spec) error {
	var layers []blob
	if spec.Base != "" {
		b, err := fileBlob(spec.Base)
		if err != nil {
			return fmt.Errorf("base layer: %w", err)
		}
		layers = append(layers, b)
	}
	if len(spec.Files) > 0 || len(spec.Symlinks) > 0 {
		data, err := filesLayer(spec.Files, spec.Symlinks)
		if err != nil {
			return err
		}
		layers = append(layers, memBlob(data))
	}
	var cfg Config
	cfg.Created = time.Unix(0, 0).UTC().Format(time.RFC3339)
	cfg.Architecture, cfg.OS = "amd64", "linux"
	cfg.Config = ImageConfig{User: spec.User, Env: spec.Env, Entrypoint: spec.Entrypoint, Cmd: spec.Cmd, WorkingDir: spec.WorkingDir}
	cfg.RootFS.Type = "layers"
	cfg.RootFS.DiffIDs = []string{}
	m := Manifest{SchemaVersion: 2, MediaType: MediaTypeManifest, Layers: []Descriptor{}}
	for _, l := range layers {
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, l.digest)
		m.Layers = append(m.Layers, Descriptor{MediaType: MediaTypeLayer, Digest: l.digest, Size: l.size})
	}
	cfgData, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	cfgBlob := memBlob(cfgData)
	m.Config = Descriptor{MediaType: MediaTypeConfig, Digest: cfgBlob.digest, Size: cfgBlob.size}
	mData, err := json.Marshal(m)
	if err != nil {
		return err
	}
	mBlob := memBlob(mData)
	idx := Index{SchemaVersion: 2, MediaType: MediaTypeIndex, Manifests: []Descriptor{{
		MediaType: MediaTypeManifest, Digest: mBlob.digest, Size: mBlob.size,
		Annotations: map[string]string{AnnotationName: spec.Name, AnnotationRefName: refName(spec.Name)},
		Platform:    &Platform{Architecture: "amd64", OS: "linux"},
	}}}
	idxData, err := json.Marshal(idx)
	if err != nil {
		return err
	}

	tw := tar.NewWriter(w)
	if err := writeDir(tw, "blobs/"); err != nil {
		return err
	}
	if err := writeDir(tw, "blobs/sha256/"); err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, b := range append(layers, cfgBlob, mBlob) {
		if seen[b.digest] {
			continue
		}
		seen[b.digest] = true
		if err := writeBlob(tw, b); err != nil {
			return err
		}
	}
	if err := writeFile(tw, "oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		return err
	}
	if err := writeFile(tw, "index.json", idxData, 0o644); err != nil {
		return err
	}
	return tw.Close()
}

// refName is the tag of a reference (what org.opencontainers.image.ref.name carries).
func refName(ref string) string {
	if i := strings.LastIndex(ref, ":"); i > strings.LastIndex(ref, "/") {
		return ref[i+1:]
	}
	return "latest"
}

func writeBlob(tw *tar.Writer, b blob) error {
	name := "blobs/sha256/" + strings.TrimPrefix(b.digest, "sha256:")
	if b.data != nil {
		return writeFile(tw, name, b.data, 0o644)
	}
	f, err := os.Open(b.file)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: b.size, Mode: 0o644, ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	n, err := io.Copy(tw, f)
	if err != nil {
		return fmt.Errorf("copying %s: %w", b.file, err)
	}
	if n != b.size {
		return fmt.Errorf("%s changed while being written (%d bytes, hashed %d)", b.file, n, b.size)
	}
	return nil
}

func writeDir(tw *tar.Writer, name string) error {
	return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: time.Unix(0, 0)})
}

func writeFile(tw *tar.Writer, name string, data []byte, mode int64) error {
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: int64(len(data)), Mode: mode, ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	_, err := tw.Write(data)
	return err
}

// filesLayer is a layer tar holding files and symlinks, with their parent directories.
func filesLayer(files []File, links []Symlink) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	var paths []string
	for _, f := range files {
		paths = append(paths, f.Path)
	}
	for _, l := range links {
		paths = append(paths, l.Path)
	}
	var parents []string
	for _, p := range paths {
		if !path.IsAbs(p) {
			return nil, fmt.Errorf("image path %q is not absolute", p)
		}
		for d := path.Dir(p); d != "/"; d = path.Dir(d) {
			if !dirs[d] {
				dirs[d] = true
				parents = append(parents, d)
			}
		}
	}
	sort.Strings(parents)
	for _, d := range parents {
		if err := writeDir(tw, strings.TrimPrefix(d, "/")+"/"); err != nil {
			return nil, err
		}
	}
	for _, f := range files {
		data, err := os.ReadFile(f.Src)
		if err != nil {
			return nil, err
		}
		st, err := os.Stat(f.Src)
		if err != nil {
			return nil, err
		}
		if err := writeFile(tw, strings.TrimPrefix(f.Path, "/"), data, int64(st.Mode().Perm())); err != nil {
			return nil, err
		}
	}
	for _, l := range links {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: strings.TrimPrefix(l.Path, "/"), Linkname: l.Target, Mode: 0o777, ModTime: time.Unix(0, 0)}); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
