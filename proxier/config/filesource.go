package config

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"hash/maphash"
	"io"
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
	entries map[string]objEntry
	stamp   string
	parsed  map[string]*parsedFile
	synced  bool
	// OnLoad, if set, is called after every load attempt with its error (nil when applied).
	OnLoad func(error)
}

// NewFileSource builds the source; Run loads and watches. interval is how often files are checked
// for changes.
func NewFileSource(path string, h Handler, c clock.Clock, interval time.Duration, log logrus.FieldLogger) *FileSource {
	return &FileSource{path: path, h: h, log: log, clock: c, interval: interval, reload: make(chan struct{}, 1),
		entries: map[string]objEntry{}, parsed: map[string]*parsedFile{}}
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
	reread := len(objs.services) + len(objs.slices)
	f.apply(objs)
	nSvc := 0
	for key := range objs.entries {
		if isServiceKey(key) {
			nSvc++
		}
	}
	f.log.WithFields(logrus.Fields{"path": f.path, "services": nSvc, "endpointslices": len(objs.entries) - nSvc,
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
	for key, e := range f.entries {
		if _, ok := objs.entries[key]; ok {
			continue
		}
		if isServiceKey(key) {
			f.h.OnServiceDelete(e.serviceStub(key))
		} else {
			f.h.OnEndpointSliceDelete(e.sliceStub(key))
		}
	}
	// Each object is decoded from its protobuf only now, handed over and let go of, so what the
	// handler builds from them and the objects are not all live at once. The slices go first: the
	// proxier selects a Service's endpoints again at each of its objects, and a Service handed
	// over before its slices had them selected (with none) and handed to the balancer once more;
	// a slice before its Service is only stored. (10,000 Services and their slices into the
	// proxier: 460,000 allocations and 76.4 MB, from 510,000 and 79.6 MB.)
	for key, pb := range objs.slices {
		delete(objs.slices, key)
		old, had := f.entries["e/"+key]
		if had && old.hash == objs.entries["e/"+key].hash {
			continue
		}
		sl := &discovery.EndpointSlice{TypeMeta: sliceType}
		if err := sl.Unmarshal(pb); err != nil {
			f.log.WithError(err).WithField("endpointslice", key).Error("Skipped an EndpointSlice of the services file: its encoding does not decode")
			continue
		}
		if had {
			f.h.OnEndpointSliceUpdate(old.sliceStub("e/"+key), sl)
		} else {
			f.h.OnEndpointSliceAdd(sl)
		}
	}
	for key, pb := range objs.services {
		delete(objs.services, key)
		old, had := f.entries["s/"+key]
		if had && old.hash == objs.entries["s/"+key].hash {
			continue
		}
		svc := &v1.Service{TypeMeta: serviceType} // not part of the encoding
		if err := svc.Unmarshal(pb); err != nil { // what prepare encoded: not expected
			f.log.WithError(err).WithField("service", key).Error("Skipped a service of the services file: its encoding does not decode")
			continue
		}
		if had {
			f.h.OnServiceUpdate(old.serviceStub("s/"+key), svc)
		} else {
			f.h.OnServiceAdd(svc)
		}
	}
	f.entries = objs.entries
	if !f.synced {
		f.synced = true
		f.h.OnServicesSynced()
		f.h.OnEndpointSlicesSynced()
	}
}

// The types of the objects a load hands over, as their manifests (apiVersion: v1 and
// discovery.k8s.io/v1) and the decoders set them.
var (
	serviceType = metav1.TypeMeta{APIVersion: "v1", Kind: kindService}
	sliceType   = metav1.TypeMeta{APIVersion: discovery.SchemeGroupVersion.String(), Kind: kindSlice}
)

// objEntry is what is kept of an applied object for the next load: the hash of its manifest,
// and what names it in a deletion event besides its key ("s/namespace/name" or
// "e/namespace/name"): the namespace's length (a name in a services file may hold a slash) and
// an EndpointSlice's kubernetes.io/service-name. One map of these, the names cut from the keys,
// is 2 MB at 10,000 Services and their slices, where a map of hashes and one of names, with
// their own copies of each name, were 4.7 MB.
type objEntry struct {
	hash  uint64
	owner string
	nsLen uint32
}

func isServiceKey(key string) bool { return key[0] == 's' }

func (e objEntry) meta(key string) metav1.ObjectMeta {
	ns := key[2 : 2+e.nsLen]
	return metav1.ObjectMeta{Namespace: ns, Name: key[3+len(ns):]}
}

func (e objEntry) serviceStub(key string) *v1.Service {
	return &v1.Service{ObjectMeta: e.meta(key)}
}

func (e objEntry) sliceStub(key string) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{ObjectMeta: e.meta(key)}
	s.Labels = map[string]string{discovery.LabelServiceName: e.owner}
	return s
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

// manifestSet is a load's objects. The decoded (re-read) objects wait for apply as their
// protobuf encoding, not as API objects: at 10,000 Services and their EndpointSlices the objects
// were 28 MB of live heap at the load's peak, beside everything the proxier builds from them
// while apply hands them over; their encodings are a sixth of that, and each is decoded again
// (generated code, no reflection) only when its turn to be handed over comes.
type manifestSet struct {
	services map[string][]byte   // namespace/name -> the Service's protobuf
	slices   map[string][]byte   // namespace/name -> the EndpointSlice's protobuf
	entries  map[string]objEntry // "s/ns/name" or "e/ns/name"; the hash is of the manifest's JSON
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
	stamp   string
	entries map[string]objEntry
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
			pf = &parsedFile{stamp: stamps[file], entries: one.entries}
		}
		fresh[file] = pf
		one.entries = pf.entries
		if len(files) == 1 {
			// One file (the usual --services-file) is the whole set: its maps serve as the
			// set's, read-only from now on, instead of a copy of them (20,000 entries each at
			// 10,000 services, kept for the next load's diff beside the file's cache).
			set = one
			if set.services == nil {
				set.services, set.slices = map[string][]byte{}, map[string][]byte{}
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
	return &manifestSet{services: map[string][]byte{}, slices: map[string][]byte{},
		entries: map[string]objEntry{}}
}

// manifestSeed seeds the hashes of manifests, which are compared only with those of the same
// process. maphash reads 8 bytes at a time where FNV-1a read one: it was 6% of a load's CPU.
var manifestSeed = maphash.MakeSeed()

// docBatch is how many documents are read and decoded at a time: enough to keep every CPU busy
// between the reads, few enough that a batch's bytes and objects are a small part of a load's
// heap. The file itself is never held whole (5 MB at 10,000 Services, and as much again in its
// documents' copies, were live until the last document was decoded).
const docBatch = 512

func parseFile(file string) (*manifestSet, error) {
	fh, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", file, err)
	}
	defer fh.Close()
	set := newManifestSet()
	batch := make([]document, 0, docBatch)
	var rejected error
	flush := func() error {
		decoded := decodeDocuments(batch)
		for i, doc := range batch {
			if err := set.addDecoded(decoded[i]); err != nil {
				// The YAML parser names the line after the last one when the document ends too
				// early; the file has no such line, so name its last.
				line := min(doc.line+errorLine(err), doc.line+max(bytes.Count(doc.body, []byte("\n"))-1, 0))
				rejected = fmt.Errorf("%s:%d: %w", file, line, err)
				return rejected
			}
		}
		clear(batch)
		batch = batch[:0]
		return nil
	}
	err = readDocuments(fh, func(doc document) error {
		if batch = append(batch, doc); len(batch) < docBatch {
			return nil
		}
		return flush()
	})
	if err == nil {
		err = flush()
	}
	switch {
	case rejected != nil:
		return nil, rejected
	case err != nil:
		return nil, fmt.Errorf("read %s: %w", file, err)
	}
	return set, nil
}

// decodedDoc is one document's objects, in order, or the error that rejects it.
type decodedDoc struct {
	objs []preparedObj
	err  error
}

type decodedObj struct {
	obj  apiruntime.Object // *v1.Service or *discovery.EndpointSlice
	hash uint64
}

// preparedObj is a decoded object as the set keeps it: its key, hash and protobuf, checked
// except against the objects before it.
type preparedObj struct {
	service bool
	key     string // namespace/name
	entry   objEntry
	pb      []byte
	// keyErr rejects the object before it is compared with those before it (it has no name);
	// err after (a duplicate is reported first).
	keyErr, err error
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
			var objs []decodedObj
			for i := int(next.Add(1) - 1); i < len(docs); i = int(next.Add(1) - 1) {
				objs = objs[:0]
				if out[i].err = decodeDocument(docs[i].body, &objs); out[i].err != nil {
					continue
				}
				for _, o := range objs {
					out[i].objs = append(out[i].objs, prepare(o))
				}
				clear(objs)
			}
		})
	}
	wg.Wait()
	return out
}

// decodeDocument appends the Services and EndpointSlices of one document (a List's items too).
func decodeDocument(body []byte, objs *[]decodedObj) error {
	// The decoded objects copy what they hold of the JSON, so its buffer serves the next document.
	p := fastParsers.Get().(*fastParser)
	defer func() {
		p.release()
		fastParsers.Put(p)
	}()
	js, gv, kind, err := manifestJSON(p, body)
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
	switch o := obj.(type) {
	case *v1.Service, *discovery.EndpointSlice:
		*objs = append(*objs, decodedObj{obj: o, hash: maphash.Bytes(manifestSeed, js)})
	case *v1.List:
		for i, item := range o.Items {
			if err := decodeDocument(item.Raw, objs); err != nil {
				return fmt.Errorf("%s item %d: %w", kind, i, err)
			}
		}
	}
	return nil
}

// prepare checks a decoded object (its namespace defaulted, a Service's clusterIPs from its
// clusterIP) and encodes it.
func prepare(o decodedObj) preparedObj {
	p := preparedObj{}
	kind := kindSlice
	switch obj := o.obj.(type) {
	case *v1.Service:
		p.service, kind = true, kindService
		if p.key, p.keyErr = objectKey(kind, &obj.ObjectMeta); p.keyErr != nil {
			return p
		}
		if len(obj.Spec.ClusterIPs) == 0 && obj.Spec.ClusterIP != "" {
			obj.Spec.ClusterIPs = []string{obj.Spec.ClusterIP}
		}
		for _, ip := range append(slices.Clone(obj.Spec.ClusterIPs), obj.Spec.ExternalIPs...) {
			if ip != v1.ClusterIPNone && !validIP(ip) {
				p.err = fmt.Errorf("%s %s: invalid IP %q", kind, p.key, ip)
				return p
			}
		}
		p.entry.nsLen = uint32(len(obj.Namespace))
	case *discovery.EndpointSlice:
		if p.key, p.keyErr = objectKey(kind, &obj.ObjectMeta); p.keyErr != nil {
			return p
		}
		if _, p.err = SliceOwner(obj); p.err != nil {
			return p
		}
		p.entry = objEntry{owner: obj.Labels[discovery.LabelServiceName], nsLen: uint32(len(obj.Namespace))}
	}
	p.entry.hash = o.hash
	var err error
	if p.pb, err = o.obj.(interface{ Marshal() ([]byte, error) }).Marshal(); err != nil {
		p.err = fmt.Errorf("%s %s: encode: %w", kind, p.key, err)
	}
	return p
}

// addDecoded adds one document's objects, checking for duplicates.
func (set *manifestSet) addDecoded(d decodedDoc) error {
	if d.err != nil {
		return d.err
	}
	for _, o := range d.objs {
		if o.keyErr != nil {
			return o.keyErr
		}
		kind, defined, prefix := kindService, set.services, "s/"
		if !o.service {
			kind, defined, prefix = kindSlice, set.slices, "e/"
		}
		if _, dup := defined[o.key]; dup {
			return fmt.Errorf("%s %s defined twice", kind, o.key)
		}
		if o.err != nil {
			return o.err
		}
		defined[o.key] = o.pb
		set.entries[prefix+o.key] = o.entry
	}
	return nil
}

// merge adds another file's objects (decoded ones only for re-read files) and their entries; an
// object defined in two files is an error.
func (set *manifestSet) merge(o *manifestSet, file string) error {
	for k, e := range o.entries {
		if _, dup := set.entries[k]; dup {
			kind := kindSlice
			if isServiceKey(k) {
				kind = kindService
			}
			return fmt.Errorf("%s: %s %s defined twice", file, kind, k[2:])
		}
		set.entries[k] = e
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
// name.
func objectKey(kind string, meta *metav1.ObjectMeta) (string, error) {
	if meta.Name == "" {
		return "", fmt.Errorf("%s without metadata.name", kind)
	}
	if meta.Namespace == "" {
		meta.Namespace = v1.NamespaceDefault
	}
	return meta.Namespace + "/" + meta.Name, nil
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
	_ = readDocuments(bytes.NewReader(data), func(d document) error {
		docs = append(docs, d)
		return nil
	})
	return docs
}

// readDocuments reads a YAML stream and cuts it at "---" lines, giving yield each document (its
// own copy) as soon as it ends, the last one even when empty. It stops at yield's first error,
// and returns it, or the reader's.
func readDocuments(r io.Reader, yield func(document) error) error {
	var cur bytes.Buffer
	start, n := 1, 0
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		n++
		line := sc.Bytes()
		if bytes.HasPrefix(line, []byte("---")) && len(bytes.TrimSpace(line[3:])) == 0 {
			if err := yield(document{line: start, body: bytes.Clone(cur.Bytes())}); err != nil {
				return err
			}
			cur.Reset()
			start = n + 1
			continue
		}
		cur.Write(line)
		cur.WriteByte('\n')
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return yield(document{line: start, body: bytes.Clone(cur.Bytes())})
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
