package config

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"hash/fnv"
	"io/fs"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sirupsen/logrus"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/utils/clock"
)

// FileSource feeds a Handler from Service and EndpointSlice manifests on disk (--services-file: a
// YAML file or a directory of them, multi-document) instead of an API server. It reloads when the
// files change or Reload is called (SIGHUP); a reload with any bad document is rejected whole, with
// the file and line, and the last good state stays in force.
type FileSource struct {
	path     string
	h        Handler
	log      logrus.FieldLogger
	clock    clock.Clock
	interval time.Duration
	reload   chan struct{}

	// Owned by Run.
	// What was last applied: per object key ("s/ns/name", "e/ns/name") the hash of its manifest
	// and enough to name it in a deletion. The decoded objects are not kept: at 10,000 services
	// they held tens of megabytes that no later load needs.
	hashes map[string]uint64
	infos  map[string]objInfo
	stamp  string
	parsed map[string]*parsedFile
	synced bool
	// OnLoad, if set, is called after every load attempt with its error (nil when applied).
	OnLoad func(error)
}

// NewFileSource builds the source; Run loads and watches. interval is how often files are checked
// for changes.
func NewFileSource(path string, h Handler, c clock.Clock, interval time.Duration, log logrus.FieldLogger) *FileSource {
	return &FileSource{path: path, h: h, log: log, clock: c, interval: interval, reload: make(chan struct{}, 1),
		hashes: map[string]uint64{}, infos: map[string]objInfo{}, parsed: map[string]*parsedFile{}}
}

// Reload asks for a reload now, even if no file changed.
func (f *FileSource) Reload() {
	select {
	case f.reload <- struct{}{}:
	default:
	}
}

// Run loads the files and then watches them until ctx is done.
func (f *FileSource) Run(ctx context.Context) error {
	f.load(true)
	for {
		timer := f.clock.NewTimer(f.interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-f.reload:
			timer.Stop()
			f.load(true)
		case <-timer.C():
			f.load(false)
		}
	}
}

// load reads the files when forced or when their names, sizes or times changed.
func (f *FileSource) load(force bool) {
	files, stamps, stamp, err := listManifests(f.path)
	if err == nil && !force && stamp == f.stamp {
		return
	}
	var objs *manifestSet
	if err == nil {
		if force {
			clear(f.parsed) // SIGHUP reads everything again
		}
		objs, err = parseManifests(files, stamps, f.parsed)
	}
	if f.OnLoad != nil {
		defer func() { f.OnLoad(err) }()
	}
	if err != nil {
		f.log.WithError(err).Error("Rejected services file; keeping the last good state")
		return
	}
	f.stamp = stamp
	f.apply(objs)
	nSvc := 0
	for _, info := range objs.infos {
		if info.service {
			nSvc++
		}
	}
	reread := len(objs.services) + len(objs.slices)
	f.log.WithFields(logrus.Fields{"path": f.path, "services": nSvc, "endpointslices": len(objs.infos) - nSvc,
		"reread": reread}).Info("Loaded services file")
	if reread >= bigLoad {
		// Decoding allocated many times what the handlers kept (about 500 MB for 10,000 services
		// and their slices); without this the heap's peak stayed resident for minutes.
		objs = nil
		debug.FreeOSMemory()
	}
}

// bigLoad is the number of decoded objects from which a load hands its garbage back to the OS at once.
const bigLoad = 1000

// apply sends the difference between the last good state and objs to the handler. Objects of
// files that did not change are not decoded again and cannot differ; a re-read file's objects are
// compared by the hash of their manifests.
func (f *FileSource) apply(objs *manifestSet) {
	for key, info := range f.infos {
		if _, ok := objs.hashes[key]; ok {
			continue
		}
		if info.service {
			f.h.OnServiceDelete(info.serviceStub())
		} else {
			f.h.OnEndpointSliceDelete(info.sliceStub())
		}
	}
	for key, svc := range objs.services {
		switch old, had := f.hashes["s/"+key]; {
		case !had:
			f.h.OnServiceAdd(svc)
		case old != objs.hashes["s/"+key]:
			f.h.OnServiceUpdate(f.infos["s/"+key].serviceStub(), svc)
		}
	}
	for key, sl := range objs.slices {
		switch old, had := f.hashes["e/"+key]; {
		case !had:
			f.h.OnEndpointSliceAdd(sl)
		case old != objs.hashes["e/"+key]:
			f.h.OnEndpointSliceUpdate(f.infos["e/"+key].sliceStub(), sl)
		}
	}
	f.hashes, f.infos = objs.hashes, objs.infos
	if !f.synced {
		f.synced = true
		f.h.OnServicesSynced()
		f.h.OnEndpointSlicesSynced()
	}
}

// objInfo is what names an object in a deletion event.
type objInfo struct {
	service         bool
	namespace, name string
	owner           string // an EndpointSlice's kubernetes.io/service-name
}

func (i objInfo) serviceStub() *v1.Service {
	return &v1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: i.namespace, Name: i.name}}
}

func (i objInfo) sliceStub() *discovery.EndpointSlice {
	return &discovery.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: i.namespace, Name: i.name,
		Labels: map[string]string{discovery.LabelServiceName: i.owner}}}
}

// listManifests returns the YAML files under path (sorted) with a stamp of each (size and
// modification time), and a stamp of the whole set.
func listManifests(path string) ([]string, map[string]string, string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, nil, "", fmt.Errorf("services file: %w", err)
	}
	var files []string
	if !st.IsDir() {
		files = []string{path}
	} else {
		err = filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			ext := filepath.Ext(p)
			if !d.IsDir() && (ext == ".yaml" || ext == ".yml" || ext == ".json") {
				files = append(files, p)
			}
			return nil
		})
		if err != nil {
			return nil, nil, "", fmt.Errorf("services directory %s: %w", path, err)
		}
	}
	slices.Sort(files)
	stamps := make(map[string]string, len(files))
	var all strings.Builder
	for _, p := range files {
		if st, err := os.Stat(p); err == nil {
			stamps[p] = fmt.Sprintf("%d %d", st.Size(), st.ModTime().UnixNano())
			fmt.Fprintf(&all, "%s %s\n", p, stamps[p])
		}
	}
	return files, stamps, all.String(), nil
}

type manifestSet struct {
	services map[string]*v1.Service
	slices   map[string]*discovery.EndpointSlice
	hashes   map[string]uint64 // "s/ns/name" or "e/ns/name" -> FNV-1a of the manifest's JSON
	infos    map[string]objInfo
}

var manifestDecoder = func() apiruntime.Decoder {
	s := apiruntime.NewScheme()
	_ = v1.AddToScheme(s)
	_ = discovery.AddToScheme(s)
	return serializer.NewCodecFactory(s).UniversalDeserializer()
}()

// parsedFile is one file's objects, reused while the file's stamp does not change, so a reload
// after one small file changed does not decode every other file again (10,000 services).
type parsedFile struct {
	stamp  string
	hashes map[string]uint64
	infos  map[string]objInfo
}

// parseManifests decodes every document of every file. Kinds other than Service, EndpointSlice
// and List are skipped (a services file may hold a whole application); a malformed document, a
// Service or EndpointSlice without a name, or a duplicate fails the whole load. Files whose stamp
// matches cache are not read again; cache is updated with what was parsed when the load succeeds.
func parseManifests(files []string, stamps map[string]string, cache map[string]*parsedFile) (*manifestSet, error) {
	set := newManifestSet()
	fresh := map[string]*parsedFile{}
	for _, file := range files {
		pf, ok := cache[file]
		one := &manifestSet{}
		if !ok || stamps[file] == "" || pf.stamp != stamps[file] {
			var err error
			if one, err = parseFile(file); err != nil {
				return nil, err
			}
			pf = &parsedFile{stamp: stamps[file], hashes: one.hashes, infos: one.infos}
		}
		fresh[file] = pf
		one.hashes, one.infos = pf.hashes, pf.infos
		if len(files) == 1 {
			// One file (the usual --services-file) is the whole set: its maps serve as the
			// set's, read-only from now on, instead of a copy of them (20,000 entries each at
			// 10,000 services, kept for the next load's diff beside the file's cache).
			set = one
			if set.services == nil {
				set.services, set.slices = map[string]*v1.Service{}, map[string]*discovery.EndpointSlice{}
			}
			break
		}
		if err := set.merge(one, file); err != nil {
			return nil, err
		}
	}
	if cache != nil {
		clear(cache)
		maps.Copy(cache, fresh)
	}
	return set, nil
}

func newManifestSet() *manifestSet {
	return &manifestSet{services: map[string]*v1.Service{}, slices: map[string]*discovery.EndpointSlice{},
		hashes: map[string]uint64{}, infos: map[string]objInfo{}}
}

func parseFile(file string) (*manifestSet, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", file, err)
	}
	docs := splitDocuments(data)
	decoded := decodeDocuments(docs)
	set := newManifestSet()
	for i, doc := range docs {
		if err := set.addDecoded(decoded[i]); err != nil {
			// The YAML parser names the line after the last one when the document ends too
			// early; the file has no such line, so name its last.
			line := min(doc.line+errorLine(err), doc.line+max(bytes.Count(doc.body, []byte("\n"))-1, 0))
			return nil, fmt.Errorf("%s:%d: %w", file, line, err)
		}
	}
	return set, nil
}

// decodedDoc is one document's objects, in order, or the error that rejects it.
type decodedDoc struct {
	objs []decodedObj
	err  error
}

type decodedObj struct {
	obj  apiruntime.Object // *v1.Service or *discovery.EndpointSlice
	hash uint64
}

// decodeDocuments decodes every document, on every CPU: YAML to JSON and JSON to the API types
// are nearly all of a load's CPU (10,000 services and their slices took over a second on one
// core). Results come back in document order, so what is added and which error is reported do not
// depend on the schedule.
func decodeDocuments(docs []document) []decodedDoc {
	out := make([]decodedDoc, len(docs))
	workers := min(runtime.GOMAXPROCS(0), len(docs)/64+1)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(docs); i = int(next.Add(1) - 1) {
				out[i].err = decodeDocument(docs[i].body, &out[i].objs)
			}
		})
	}
	wg.Wait()
	return out
}

// decodeDocument appends the Services and EndpointSlices of one document (a List's items too).
func decodeDocument(body []byte, objs *[]decodedObj) error {
	js, gv, kind, err := manifestJSON(body)
	if err != nil {
		return err
	}
	if js == nil {
		return nil // an empty document
	}
	obj, err := decodeKnown(js, gv, kind)
	if err != nil {
		return err
	}
	if obj == nil { // another kind, or one to leave to the API machinery's checks and errors
		var gvk *schema.GroupVersionKind
		if obj, gvk, err = manifestDecoder.Decode(js, nil, nil); err != nil {
			if apiruntime.IsNotRegisteredError(err) {
				return nil
			}
			return err
		}
		kind = gvk.Kind
	}
	h := fnv.New64a()
	h.Write(js)
	switch o := obj.(type) {
	case *v1.Service, *discovery.EndpointSlice:
		*objs = append(*objs, decodedObj{obj: o, hash: h.Sum64()})
	case *v1.List:
		for i, item := range o.Items {
			if err := decodeDocument(item.Raw, objs); err != nil {
				return fmt.Errorf("%s item %d: %w", kind, i, err)
			}
		}
	}
	return nil
}

// addDecoded adds one document's objects, checking names and duplicates.
func (set *manifestSet) addDecoded(d decodedDoc) error {
	if d.err != nil {
		return d.err
	}
	for _, o := range d.objs {
		var err error
		switch obj := o.obj.(type) {
		case *v1.Service:
			err = set.addService(obj, o.hash)
		case *discovery.EndpointSlice:
			err = set.addSlice(obj, o.hash)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// merge adds another file's objects (decoded ones only for re-read files) and their hashes; an
// object defined in two files is an error.
func (set *manifestSet) merge(o *manifestSet, file string) error {
	for k, h := range o.hashes {
		if _, dup := set.hashes[k]; dup {
			kind := "EndpointSlice"
			if o.infos[k].service {
				kind = "Service"
			}
			return fmt.Errorf("%s: %s %s defined twice", file, kind, k[2:])
		}
		set.hashes[k] = h
		set.infos[k] = o.infos[k]
	}
	maps.Copy(set.services, o.services)
	maps.Copy(set.slices, o.slices)
	return nil
}

// Kinds as manifests spell them; errors name an object by its kind and namespace/name.
const (
	kindService = "Service"
	kindSlice   = "EndpointSlice"
)

// objectKey defaults meta's namespace and returns "namespace/name", refusing an object without a
// name or one whose key the set already defines.
func objectKey[T any](kind string, meta *metav1.ObjectMeta, defined map[string]T) (string, error) {
	if meta.Name == "" {
		return "", fmt.Errorf("%s without metadata.name", kind)
	}
	if meta.Namespace == "" {
		meta.Namespace = v1.NamespaceDefault
	}
	key := meta.Namespace + "/" + meta.Name
	if _, dup := defined[key]; dup {
		return "", fmt.Errorf("%s %s defined twice", kind, key)
	}
	return key, nil
}

func (set *manifestSet) addService(s *v1.Service, hash uint64) error {
	key, err := objectKey(kindService, &s.ObjectMeta, set.services)
	if err != nil {
		return err
	}
	if len(s.Spec.ClusterIPs) == 0 && s.Spec.ClusterIP != "" {
		s.Spec.ClusterIPs = []string{s.Spec.ClusterIP}
	}
	for _, ip := range append(slices.Clone(s.Spec.ClusterIPs), s.Spec.ExternalIPs...) {
		if ip != v1.ClusterIPNone && !validIP(ip) {
			return fmt.Errorf("%s %s: invalid IP %q", kindService, key, ip)
		}
	}
	set.services[key] = s
	set.hashes["s/"+key] = hash
	set.infos["s/"+key] = objInfo{service: true, namespace: s.Namespace, name: s.Name}
	return nil
}

func (set *manifestSet) addSlice(s *discovery.EndpointSlice, hash uint64) error {
	key, err := objectKey(kindSlice, &s.ObjectMeta, set.slices)
	if err != nil {
		return err
	}
	if _, err := SliceOwner(s); err != nil {
		return err
	}
	set.slices[key] = s
	set.hashes["e/"+key] = hash
	set.infos["e/"+key] = objInfo{namespace: s.Namespace, name: s.Name, owner: s.Labels[discovery.LabelServiceName]}
	return nil
}

func validIP(s string) bool {
	_, err := netip.ParseAddr(s)
	return err == nil
}

type document struct {
	line int // 1-based line of the document's first line
	body []byte
}

// splitDocuments cuts a YAML stream at "---" lines, remembering where each document starts so
// errors can name the line.
func splitDocuments(data []byte) []document {
	var docs []document
	var cur bytes.Buffer
	start, n := 1, 0
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		n++
		line := sc.Text()
		if strings.HasPrefix(line, "---") && strings.TrimSpace(strings.TrimPrefix(line, "---")) == "" {
			docs = append(docs, document{line: start, body: bytes.Clone(cur.Bytes())})
			cur.Reset()
			start = n + 1
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
	}
	return append(docs, document{line: start, body: cur.Bytes()})
}

var yamlLine = regexp.MustCompile(`line (\d+)`)

// errorLine extracts the 1-based line a YAML error names, as an offset within its document (0
// when the error names none).
func errorLine(err error) int {
	m := yamlLine.FindStringSubmatch(err.Error())
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return max(n-1, 0)
}
