package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kube-portal-proxy/kube-portal-proxy/internal/deploy"
)

// The image cannot be built here (no container engine); these tests check everything around
// the build that can be checked: the build command, the base images, the packages and the binary.

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct{ cmd, args string }

func dockerfile(t *testing.T) []instruction {
	t.Helper()
	f, err := os.Open("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []instruction
	var cur strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		cont := strings.HasSuffix(l, "\\")
		cur.WriteString(strings.TrimSuffix(l, "\\"))
		if cont {
			cur.WriteString(" ")
			continue
		}
		cmd, args, _ := strings.Cut(cur.String(), " ")
		out = append(out, instruction{strings.ToUpper(cmd), strings.TrimSpace(args)})
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func find(ins []instruction, cmd, contains string) []string {
	var out []string
	for _, i := range ins {
		if i.cmd == cmd && strings.Contains(i.args, contains) {
			out = append(out, i.args)
		}
	}
	return out
}

// imageEntrypoint is the binary the image runs.
func imageEntrypoint(t *testing.T) string {
	t.Helper()
	ep := find(dockerfile(t), "ENTRYPOINT", "")
	if len(ep) != 1 {
		t.Fatalf("want one ENTRYPOINT, got %q", ep)
	}
	var argv []string
	if err := json.Unmarshal([]byte(ep[0]), &argv); err != nil || len(argv) != 1 {
		t.Fatalf("ENTRYPOINT %s: want the exec form with the binary only", ep[0])
	}
	return argv[0]
}

var varRef = regexp.MustCompile(`\$[({]([A-Z_]+)[)}]`)

// buildFlags normalises a go build command line: environment, flags and package, with $(VAR)
// and ${VAR} written as $VAR and the output path dropped.
func buildFlags(line string) []string {
	var out []string
	fields := shellFields(varRef.ReplaceAllString(line, "$$$1"))
	for i := 0; i < len(fields); i++ {
		switch f := fields[i]; f {
		case "go", "build", "$GO":
		case "-o":
			i++
		case "-ldflags":
			i++
			out = append(out, "-ldflags="+fields[i])
		default:
			out = append(out, f)
		}
	}
	return out
}

// shellFields splits a command line at blanks outside quotes and removes the quotes.
func shellFields(s string) []string {
	var out []string
	var cur strings.Builder
	var quote rune
	inField := false
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			cur.WriteRune(r)
		case r == '"' || r == '\'':
			quote, inField = r, true
		case r == ' ' || r == '\t':
			if inField {
				out = append(out, cur.String())
				cur.Reset()
				inField = false
			}
		default:
			cur.WriteRune(r)
			inField = true
		}
	}
	if inField {
		out = append(out, cur.String())
	}
	return out
}

func TestDockerfileBuildsLikeMake(t *testing.T) {
	mk, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	ldflags := regexp.MustCompile(`(?m)^LDFLAGS := (.*)$`).FindSubmatch(mk)
	recipe := regexp.MustCompile(`(?m)^build:.*\n\t(.*)$`).FindSubmatch(mk)
	if ldflags == nil || recipe == nil {
		t.Fatal("Makefile has no LDFLAGS or build recipe")
	}
	makeLine := strings.ReplaceAll(string(recipe[1]), "$(LDFLAGS)", string(ldflags[1]))

	runs := find(dockerfile(t), "RUN", "go build")
	if len(runs) != 1 {
		t.Fatalf("want one RUN with go build, got %q", runs)
	}
	if diff := cmp.Diff(buildFlags(makeLine), buildFlags(runs[0])); diff != "" {
		t.Errorf("Dockerfile build differs from make build (-make +Dockerfile):\n%s", diff)
	}
}

func TestBuildFlags(t *testing.T) {
	got := buildFlags(`CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-X main.version=$(VERSION) -s' -o /out/x .`)
	want := []string{"CGO_ENABLED=0", "-trimpath", "-ldflags=-X main.version=$VERSION -s", "."}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("buildFlags (-want +got):\n%s", diff)
	}
}

func TestDockerfileBaseImages(t *testing.T) {
	ins := dockerfile(t)
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	goLine := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	if goLine == nil {
		t.Fatal("go.mod has no go line")
	}
	if args := find(ins, "ARG", "GO_VERSION="); len(args) != 1 || args[0] != "GO_VERSION="+string(goLine[1]) {
		t.Errorf("ARG GO_VERSION = %q, want go.mod's %s", args, goLine[1])
	}
	var froms []string
	for _, i := range ins {
		if i.cmd == "FROM" {
			froms = append(froms, i.args)
		}
	}
	want := []string{"golang:${GO_VERSION} AS build", "debian:bookworm-slim"}
	if diff := cmp.Diff(want, froms); diff != "" {
		t.Errorf("stages (-want +got):\n%s", diff)
	}
	if got := imageEntrypoint(t); len(find(ins, "COPY", "--from=build /out/kube-portal-proxy "+got)) != 1 {
		t.Errorf("ENTRYPOINT %s is not where the binary is copied", got)
	}
}

// aptPackages are the packages the runtime stage installs.
func aptPackages(t *testing.T) []string {
	runs := find(dockerfile(t), "RUN", "apt-get install")
	if len(runs) != 1 {
		t.Fatalf("want one RUN with apt-get install, got %q", runs)
	}
	_, rest, _ := strings.Cut(runs[0], "apt-get install")
	rest, _, _ = strings.Cut(rest, "&&")
	var pkgs []string
	for _, f := range strings.Fields(rest) {
		if !strings.HasPrefix(f, "-") {
			pkgs = append(pkgs, f)
		}
	}
	return pkgs
}

// TestImagePackagesProvideTheTools checks, on a Debian bookworm host (the runtime base), that
// the packages the Dockerfile installs own every binary the proxy execs, and that the
// alternatives it selects exist. The proxy execs only the iptables tools and nft (the
// transparent source mode's bridge table): conntrack entries, links, addresses, rules and routes
// go over netlink (portal/conntrack, portal/bind, portal/transparent), so the image needs
// neither conntrack nor iproute2 and installs only iptables and nftables.
func TestImagePackagesProvideTheTools(t *testing.T) {
	pkgs := aptPackages(t)
	if want := []string{"iptables", "nftables"}; !slices.Equal(pkgs, want) {
		t.Errorf("apt-get install %v, want %v (the packages of the binaries the proxy execs)", pkgs, want)
	}
	osr, _ := os.ReadFile("/etc/os-release")
	if !strings.Contains(string(osr), "VERSION_CODENAME=bookworm") {
		t.Skip("not a Debian bookworm host: cannot check package contents against the image's base")
	}
	if _, err := exec.LookPath("dpkg"); err != nil {
		t.Skip("no dpkg")
	}
	var tools []string
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, variant := range []string{"-nft", "-legacy"} {
			for _, tool := range []string{"", "-save", "-restore"} {
				tools = append(tools, "/usr/sbin/"+fam+variant+tool) // iptables.ExecRunner's names
			}
		}
	}
	tools = append(tools, "/usr/sbin/nft") // transparent.ExecRunner's
	for _, tool := range tools {
		out, err := exec.Command("dpkg", "-S", tool).Output()
		if err != nil {
			t.Errorf("dpkg -S %s: %v (not installed on this host?)", tool, err)
			continue
		}
		pkg, _, _ := strings.Cut(string(out), ":")
		if !slices.Contains(pkgs, pkg) {
			t.Errorf("%s comes from package %s, which the image does not install", tool, pkg)
		}
	}
	for _, set := range find(dockerfile(t), "RUN", "update-alternatives") {
		for _, m := range regexp.MustCompile(`update-alternatives --set (\S+) (\S+)`).FindAllStringSubmatch(set, -1) {
			out, err := exec.Command("update-alternatives", "--list", m[1]).Output()
			if err != nil || !slices.Contains(strings.Fields(string(out)), m[2]) {
				t.Errorf("update-alternatives --set %s %s: not a choice here (%q, %v)", m[1], m[2], out, err)
			}
		}
	}
}

// TestImageBuildCommand runs the Dockerfile's go build and checks the binary: static, paths
// trimmed, version stamped.
func TestImageBuildCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	runs := find(dockerfile(t), "RUN", "go build")
	if len(runs) != 1 {
		t.Fatalf("want one RUN with go build, got %q", runs)
	}
	bin := filepath.Join(t.TempDir(), "kube-portal-proxy")
	line := strings.ReplaceAll(runs[0], "/out/kube-portal-proxy", bin)
	cmd := exec.Command("sh", "-c", line)
	cmd.Env = append(os.Environ(), "VERSION=v9.8.7-test")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", line, err, out)
	}
	out, err := exec.Command(bin, "--version").Output()
	if err != nil || string(out) != "kube-portal-proxy v9.8.7-test\n" {
		t.Errorf("--version = %q, %v; want the stamped version", out, err)
	}
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary is dynamically linked: the image needs a static one (CGO_ENABLED=0)")
		}
	}
	info, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	settings := map[string]string{}
	for _, s := range info.Settings {
		settings[s.Key] = s.Value
	}
	for k, want := range map[string]string{"CGO_ENABLED": "0", "-trimpath": "true"} {
		if settings[k] != want {
			t.Errorf("build setting %s = %q, want %q", k, settings[k], want)
		}
	}
}

// TestDeployRunsTheImage checks that the DaemonSet in deploy/ runs this image's binary.
func TestDeployRunsTheImage(t *testing.T) {
	m, err := deploy.Load("deploy")
	if err != nil {
		t.Fatalf("deploy.Load: %v", err)
	}
	c, err := m.Container()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(c.Image, "ghcr.io/kube-portal-proxy/kube-portal-proxy:") {
		t.Errorf("image = %q", c.Image)
	}
	if diff := cmp.Diff([]string{imageEntrypoint(t)}, c.Command); diff != "" {
		t.Errorf("command (-want +got), as the Dockerfile's ENTRYPOINT:\n%s", diff)
	}
}

// shellVar is the value of a top-level NAME=value assignment in a script, quotes removed.
func shellVar(t *testing.T, script, name string) string {
	t.Helper()
	data, err := os.ReadFile(script)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + name + `=(.*)$`).FindSubmatch(data)
	if m == nil {
		t.Fatalf("%s: no %s=", script, name)
	}
	return strings.Trim(string(m[1]), `"'`)
}

// dockerfileImage is what the Dockerfile's runtime stage puts in the image, as
// make image-oci's scripts spell it.
type dockerfileImage struct {
	Packages     []string
	Alternatives []string // name=path
	BinaryPath   string
	Symlinks     []string // path=target
	Entrypoint   string
}

func fromDockerfile(t *testing.T) dockerfileImage {
	ins := dockerfile(t)
	var img dockerfileImage
	img.Packages = aptPackages(t)
	slices.Sort(img.Packages)
	for _, set := range find(ins, "RUN", "update-alternatives") {
		for _, m := range regexp.MustCompile(`update-alternatives --set (\S+) (\S+)`).FindAllStringSubmatch(set, -1) {
			img.Alternatives = append(img.Alternatives, m[1]+"="+m[2])
		}
	}
	copies := find(ins, "COPY", "--from=build /out/kube-portal-proxy ")
	if len(copies) != 1 {
		t.Fatalf("want one COPY of the binary, got %q", copies)
	}
	img.BinaryPath = strings.Fields(copies[0])[2]
	for _, ln := range find(ins, "RUN", "ln -s") {
		f := strings.Fields(ln)
		if len(f) != 4 {
			t.Fatalf("RUN %s: want ln -s TARGET PATH", ln)
		}
		img.Symlinks = append(img.Symlinks, f[3]+"="+f[2])
	}
	img.Entrypoint = imageEntrypoint(t)
	return img
}

// TestImageOCIScriptsDescribeTheDockerfileImage checks that make image-oci (hack/oci) builds
// what the Dockerfile builds: the same Debian packages and iptables alternatives, the binary
// at the same path, the same symlink and entrypoint.
func TestImageOCIScriptsDescribeTheDockerfileImage(t *testing.T) {
	var got dockerfileImage
	got.Packages = strings.Fields(shellVar(t, "hack/oci/rootfs.sh", "PACKAGES"))
	slices.Sort(got.Packages)
	got.Alternatives = strings.Fields(shellVar(t, "hack/oci/rootfs.sh", "ALTERNATIVES"))
	got.BinaryPath = shellVar(t, "hack/oci/image.sh", "BINARY_PATH")
	got.Symlinks = strings.Fields(shellVar(t, "hack/oci/image.sh", "SYMLINK"))
	got.Entrypoint = shellVar(t, "hack/oci/image.sh", "ENTRYPOINT")
	if diff := cmp.Diff(fromDockerfile(t), got); diff != "" {
		t.Errorf("make image-oci differs from the Dockerfile (-Dockerfile +hack/oci):\n%s", diff)
	}
	if base := find(dockerfile(t), "FROM", "debian:"); len(base) != 1 || base[0] != "debian:bookworm-slim" {
		t.Errorf("runtime base %q: hack/oci/rootfs.sh installs bookworm minbase", base)
	}
	if !strings.Contains(readFile(t, "hack/oci/rootfs.sh"), "--variant=minbase") ||
		!strings.Contains(readFile(t, "hack/oci/rootfs.sh"), " bookworm ") {
		t.Error("hack/oci/rootfs.sh does not build bookworm minbase (what debian:bookworm-slim holds)")
	}
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestImageOCIIsTheDockerfileImage opens an image make image-oci wrote (KPP_IMAGE_OCI, set by
// make image-oci-test) and checks it against the Dockerfile: entrypoint and PATH in the config,
// the static binary and the symlink in the layers, the packages installed in dpkg's status and
// the alternatives selected.
func TestImageOCIIsTheDockerfileImage(t *testing.T) {
	file := os.Getenv("KPP_IMAGE_OCI")
	if file == "" {
		t.Skip("KPP_IMAGE_OCI not set (make image-oci-test builds the image and runs this)")
	}
	want := fromDockerfile(t)
	img := readOCIImage(t, file)
	if diff := cmp.Diff([]string{want.Entrypoint}, img.config.Config.Entrypoint); diff != "" {
		t.Errorf("entrypoint (-Dockerfile +image):\n%s", diff)
	}
	if !slices.Contains(img.config.Config.Env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") {
		t.Errorf("env %q lacks debian's PATH", img.config.Config.Env)
	}
	if img.config.Config.User != "" {
		t.Errorf("user %q: the Dockerfile runs as root", img.config.Config.User)
	}
	binPath := strings.TrimPrefix(want.BinaryPath, "/")
	bin, ok := img.files[binPath]
	if !ok || bin.Typeflag != tar.TypeReg || bin.Mode&0o111 == 0 {
		t.Fatalf("%s: not an executable file in the image", want.BinaryPath)
	}
	f, err := elf.NewFile(bytes.NewReader(img.bodies[binPath]))
	if err != nil {
		t.Fatalf("%s: %v", want.BinaryPath, err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s is dynamically linked", want.BinaryPath)
		}
	}
	for _, s := range append(want.Symlinks, alternativeLinks(want.Alternatives)...) {
		p, target, _ := strings.Cut(s, "=")
		if h, ok := img.files[strings.TrimPrefix(p, "/")]; !ok || h.Typeflag != tar.TypeSymlink || h.Linkname != target {
			t.Errorf("%s: want a symlink to %s, got %+v", p, target, h)
		}
	}
	status := string(img.bodies["var/lib/dpkg/status"])
	for _, pkg := range want.Packages {
		if !strings.Contains(status, "Package: "+pkg+"\nStatus: install ok installed\n") {
			t.Errorf("package %s is not installed in the image", pkg)
		}
	}
}

func alternativeLinks(alts []string) []string {
	var out []string
	for _, a := range alts {
		name, path, _ := strings.Cut(a, "=")
		out = append(out, "/etc/alternatives/"+name+"="+path)
	}
	return out
}

type ociImage struct {
	config struct {
		Config struct {
			Entrypoint, Env []string
			User            string
		} `json:"config"`
	}
	files  map[string]*tar.Header // merged layers, paths without ./ or /
	bodies map[string][]byte      // contents of the files the test reads
}

func readOCIImage(t *testing.T, file string) ociImage {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	blobs := map[string]string{} // name -> temp file
	dir := t.TempDir()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		p := filepath.Join(dir, strings.ReplaceAll(h.Name, "/", "_"))
		out, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, tr); err != nil {
			t.Fatal(err)
		}
		out.Close()
		blobs[h.Name] = p
	}
	readJSON := func(name string, v any) {
		t.Helper()
		b, err := os.ReadFile(blobs[name])
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	type desc struct {
		Digest      string
		Annotations map[string]string
	}
	var idx struct{ Manifests []desc }
	readJSON("index.json", &idx)
	if len(idx.Manifests) != 1 || idx.Manifests[0].Annotations["io.containerd.image.name"] == "" {
		t.Fatalf("index.json: want one manifest named by io.containerd.image.name, got %+v", idx.Manifests)
	}
	blobName := func(d string) string { return "blobs/sha256/" + strings.TrimPrefix(d, "sha256:") }
	var m struct {
		Config desc
		Layers []desc
	}
	readJSON(blobName(idx.Manifests[0].Digest), &m)
	var img ociImage
	readJSON(blobName(m.Config.Digest), &img.config)
	img.files, img.bodies = map[string]*tar.Header{}, map[string][]byte{}
	for _, l := range m.Layers {
		lf, err := os.Open(blobs[blobName(l.Digest)])
		if err != nil {
			t.Fatal(err)
		}
		lr := tar.NewReader(lf)
		for {
			h, err := lr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			name := strings.TrimPrefix(strings.TrimPrefix(h.Name, "./"), "/")
			img.files[name] = h
			if name == "var/lib/dpkg/status" || h.Typeflag == tar.TypeReg && strings.HasPrefix(name, "usr/local/bin/") {
				b, err := io.ReadAll(lr)
				if err != nil {
					t.Fatal(err)
				}
				img.bodies[name] = b
			}
		}
		lf.Close()
	}
	return img
}
