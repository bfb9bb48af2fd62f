// Command oci writes an OCI image layout tarball (the format `ctr images import` and `docker load`
// read) without a container engine: an optional base root filesystem tar as the first layer, the
// files and symlinks given as flags as a second layer, an image config and a manifest, and an
// index.json whose one descriptor names the image (io.containerd.image.name, and the OCI
// org.opencontainers.image.ref.name) for linux/amd64.
//
//	go run ./hack/oci -o image.tar -name example.org/x:dev -base rootfs.tar \
//	  -add bin/x=/usr/local/bin/x -symlink /usr/local/bin/y=x -entrypoint /usr/local/bin/x
//
// Layers are stored uncompressed (their digest is their diff ID); every entry the program writes
// has mtime 0 and root ownership, so the same inputs give the same digests.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// listFlag collects a repeated flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	var (
		spec             Spec
		out              string
		adds, links, env listFlag
		entrypoint, cmd  listFlag
	)
	flag.StringVar(&out, "o", "", "output tarball (OCI image layout)")
	flag.StringVar(&spec.Name, "name", "", "image reference, e.g. registry.k8s.io/pause:3.10.2")
	flag.StringVar(&spec.Base, "base", "", "root filesystem tar used as the first layer (optional)")
	flag.Var(&adds, "add", "SRC=DST: copy the local file SRC to DST in the image, mode kept (repeatable)")
	flag.Var(&links, "symlink", "PATH=TARGET: a symlink in the image (repeatable)")
	flag.Var(&entrypoint, "entrypoint", "entrypoint argument (repeatable, in order)")
	flag.Var(&cmd, "cmd", "command argument (repeatable, in order)")
	flag.Var(&env, "env", "K=V in the image's environment (repeatable; default PATH as Debian's images)")
	flag.StringVar(&spec.User, "user", "", "user the image runs as (default root)")
	flag.StringVar(&spec.WorkingDir, "workdir", "", "working directory")
	flag.Parse()
	if out == "" || spec.Name == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: oci -o OUT.tar -name REF [-base rootfs.tar] [-add SRC=DST] [-symlink PATH=TARGET] [-entrypoint ARG]... [-cmd ARG]... [-env K=V]... [-user U] [-workdir D]")
		os.Exit(2)
	}
	for _, a := range adds {
		src, dst, ok := strings.Cut(a, "=")
		if !ok {
			fatalf("-add %q: want SRC=DST", a)
		}
		spec.Files = append(spec.Files, File{Src: src, Path: dst})
	}
	for _, l := range links {
		p, target, ok := strings.Cut(l, "=")
		if !ok {
			fatalf("-symlink %q: want PATH=TARGET", l)
		}
		spec.Symlinks = append(spec.Symlinks, Symlink{Path: p, Target: target})
	}
	spec.Entrypoint, spec.Cmd, spec.Env = entrypoint, cmd, env
	if len(spec.Env) == 0 {
		spec.Env = []string{DefaultPath}
	}
	f, err := os.Create(out + ".tmp")
	if err != nil {
		fatalf("%v", err)
	}
	if err := Write(f, spec); err != nil {
		f.Close()
		os.Remove(out + ".tmp")
		fatalf("writing %s: %v", out, err)
	}
	if err := f.Close(); err != nil {
		fatalf("%v", err)
	}
	if err := os.Rename(out+".tmp", out); err != nil {
		fatalf("%v", err)
	}
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "oci: "+format+"\n", args...)
	os.Exit(1)
}
