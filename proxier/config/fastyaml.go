package config

// fastyaml.go: the common shape of a services file (block mappings and sequences, one-line flow
// collections, plain and simply quoted scalars) straight to JSON, without the YAML parser's token
// queue and node tree, which were most of the 430 MB a 10,000-service load allocated. It accepts
// only what it can convert exactly as manifestJSON's parser path would, byte for byte (the fuzz
// target checks this); anything else (comments after a value, tags, anchors, block scalars,
// multi-line scalars, escapes, YAML 1.1's yes/no/on/off, numbers other than plain integers,
// duplicate keys, odd indentation) is not an error here but a miss: the document goes the old
// way, so every error and its position stay the YAML parser's.

import (
	"bytes"
	"slices"
	"strings"
	"sync"
)

// fastLine is one line of a document that is neither blank nor a comment.
type fastLine struct {
	indent int
	text   string // after the indentation, trailing spaces removed
}

type fastParser struct {
	lines []fastLine
	i     int
	out   []byte
	keys  []string // keys of the open mappings, innermost last, for duplicates
}

// fastManifestJSON converts body as manifestJSON would, or reports ok false when the document is
// not one it takes.
func fastManifestJSON(body []byte) (js []byte, apiVersion, kind string, ok bool) {
	return new(fastParser).convert(body)
}

// fastParsers are parsers whose buffers (the lines, the JSON) serve one document after another:
// made for each, they were 56 MB of the 87 MB a 10,000-service load allocated.
var fastParsers = sync.Pool{New: func() any { return new(fastParser) }}

// release lets go of what the last document left in p's buffers, keeping the buffers.
func (p *fastParser) release() {
	clear(p.lines)
	clear(p.keys)
	p.lines, p.keys, p.out = p.lines[:0], p.keys[:0], p.out[:0]
}

// convert is fastManifestJSON with p's buffers: js is p's, good until p converts again or is
// released.
func (p *fastParser) convert(body []byte) (js []byte, apiVersion, kind string, ok bool) {
	p.release()
	p.i = 0
	p.lines = slices.Grow(p.lines, bytes.Count(body, []byte("\n"))+1)
	for line := range strings.SplitSeq(string(body), "\n") {
		n := 0
		for n < len(line) && line[n] == ' ' {
			n++
		}
		text := strings.TrimRight(line[n:], " ")
		if text == "" {
			continue
		}
		// A comment is checked too: the parser rejects a document with invalid UTF-8 or a
		// control character anywhere, its comments included (FuzzFastManifestJSON, corpus file
		// 64659c7e05a7416f: a comment line "#\x8a" was skipped here).
		if !plainASCII(text) {
			return nil, "", "", false
		}
		if text[0] == '#' {
			continue
		}
		if strings.Contains(text, " #") || text == "..." {
			return nil, "", "", false
		}
		p.lines = append(p.lines, fastLine{indent: n, text: text})
	}
	if len(p.lines) == 0 || p.lines[0].indent != 0 || isSeqItem(p.lines[0].text) {
		return nil, "", "", false
	}
	p.out = slices.Grow(p.out, len(body)+len(body)/2)
	if !p.mapping(0, func(key, s string) {
		switch key {
		case "apiVersion":
			apiVersion = s
		case "kind":
			kind = s
		}
	}) || p.i != len(p.lines) {
		return nil, "", "", false
	}
	return p.out, apiVersion, kind, true
}

func isSeqItem(text string) bool { return text == "-" || strings.HasPrefix(text, "- ") }

// mapping converts the block mapping whose keys are at column col. top, if set, is told each
// key's string value.
func (p *fastParser) mapping(col int, top func(key, s string)) bool {
	p.out = append(p.out, '{')
	open := len(p.keys)
	for first := true; p.i < len(p.lines); first = false {
		l := p.lines[p.i]
		if l.indent < col || (l.indent == col && isSeqItem(l.text)) {
			break
		}
		if l.indent > col {
			return false
		}
		key, rest, ok := blockEntry(l.text)
		if !ok || !p.newKey(open, key) {
			return false
		}
		if !first {
			p.out = append(p.out, ',')
		}
		p.out = append(appendJSONString(p.out, key), ':')
		p.i++
		if rest != "" {
			s, isStr, ok := p.value(rest)
			if !ok {
				return false
			}
			if top != nil && isStr {
				top(key, s)
			}
			continue
		}
		// The value is the block below: a sequence (which may sit at the key's column) or a
		// mapping. Nothing there is a null: left to the parser.
		if p.i == len(p.lines) {
			return false
		}
		switch n := p.lines[p.i]; {
		case n.indent >= col && isSeqItem(n.text):
			ok = p.sequence(n.indent)
		case n.indent > col:
			ok = p.mapping(n.indent, nil)
		default:
			ok = false
		}
		if !ok {
			return false
		}
	}
	p.keys = p.keys[:open]
	p.out = append(p.out, '}')
	return true
}

// newKey records key in the innermost mapping (whose keys start at open), refusing a duplicate.
func (p *fastParser) newKey(open int, key string) bool {
	for _, k := range p.keys[open:] {
		if k == key {
			return false
		}
	}
	p.keys = append(p.keys, key)
	return true
}

// sequence converts the block sequence whose dashes are at column col.
func (p *fastParser) sequence(col int) bool {
	p.out = append(p.out, '[')
	for first := true; p.i < len(p.lines); first = false {
		l := p.lines[p.i]
		if l.indent != col || !isSeqItem(l.text) {
			break
		}
		if !first {
			p.out = append(p.out, ',')
		}
		rest := strings.TrimLeft(l.text[1:], " ")
		if rest == "" || isSeqItem(rest) {
			return false
		}
		if _, _, ok := blockEntry(rest); ok {
			// "- key: value": a mapping whose keys are at the column after the dash's spaces.
			inner := col + len(l.text) - len(rest)
			p.lines[p.i] = fastLine{indent: inner, text: rest}
			if !p.mapping(inner, nil) {
				return false
			}
			continue
		}
		if _, _, ok := p.value(rest); !ok {
			return false
		}
		p.i++
	}
	if p.i < len(p.lines) && p.lines[p.i].indent > col {
		return false
	}
	p.out = append(p.out, ']')
	return true
}

// blockEntry splits "key: rest" or "key:" with a plain key.
func blockEntry(text string) (key, rest string, ok bool) {
	n := plainKeyLen(text)
	if n == 0 || n == len(text) || text[n] != ':' || (n+1 < len(text) && text[n+1] != ' ') {
		return "", "", false
	}
	return text[:n], strings.TrimLeft(text[n+1:], " "), true
}

// plainKeyLen is the length of the key at the start of s: a letter, then letters, digits and
// ._/- (API field names, label and annotation keys), 0 if none or one YAML 1.1 reads as a bool
// or null.
func plainKeyLen(s string) int {
	if s == "" || !isLetter(s[0]) {
		return 0
	}
	n := 1
	for n < len(s) && (isLetter(s[n]) || isDigit(s[n]) || strings.IndexByte("._/-", s[n]) >= 0) {
		n++
	}
	if special(s[:n]) {
		return 0
	}
	return n
}

func isLetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }
func isDigit(c byte) bool  { return c >= '0' && c <= '9' }

// special reports the words YAML 1.1 resolves to a bool or null (in any case, to be safe).
func special(s string) bool {
	if len(s) > 5 {
		return false
	}
	switch strings.ToLower(s) {
	case "y", "yes", "n", "no", "on", "off", "true", "false", "null":
		return true
	}
	return false
}

// value converts a value that is the rest of a line: a flow collection, a quoted or a plain
// scalar. s is the scalar's text when it is a string.
func (p *fastParser) value(text string) (s string, isStr, ok bool) {
	switch text[0] {
	case '{', '[':
		rest, ok := p.flow(text)
		return "", false, ok && rest == ""
	}
	s, isStr, rest, ok := p.scalar(text, false)
	return s, isStr, ok && rest == ""
}

// flow converts the flow collection at the start of text (on one line) and returns what follows it.
func (p *fastParser) flow(text string) (string, bool) {
	closer := byte(']')
	if text[0] == '{' {
		closer = '}'
	}
	p.out = append(p.out, text[0])
	open := len(p.keys)
	text = strings.TrimLeft(text[1:], " ")
	if text == "" {
		return "", false // continues on the next line
	}
	for text[0] != closer {
		if closer == '}' {
			n := plainKeyLen(text)
			if n == 0 || n+1 >= len(text) || text[n] != ':' || text[n+1] != ' ' || !p.newKey(open, text[:n]) {
				return "", false
			}
			p.out = append(appendJSONString(p.out, text[:n]), ':')
			if text = strings.TrimLeft(text[n+1:], " "); text == "" {
				return "", false
			}
		}
		var ok bool
		if text[0] == '{' || text[0] == '[' {
			text, ok = p.flow(text)
		} else {
			_, _, text, ok = p.scalar(text, true)
		}
		if text = strings.TrimLeft(text, " "); !ok || text == "" {
			return "", false
		}
		if text[0] == closer {
			break
		}
		if text[0] != ',' {
			return "", false
		}
		// A trailing comma, or an entry on the next line: left to the parser.
		if text = strings.TrimLeft(text[1:], " "); text == "" || text[0] == closer {
			return "", false
		}
		p.out = append(p.out, ',')
	}
	p.keys = p.keys[:open]
	p.out = append(p.out, closer)
	return text[1:], true
}

// scalar converts the scalar at the start of text and returns what follows it (in a flow
// collection, from the "," or closing bracket; else nothing). s is its text when it is a string.
func (p *fastParser) scalar(text string, inFlow bool) (s string, isStr bool, rest string, ok bool) {
	switch text[0] {
	case '"':
		// Without escapes a double-quoted scalar is its text.
		end := strings.IndexByte(text[1:], '"')
		if end < 0 || strings.IndexByte(text[1:1+end], '\\') >= 0 {
			return "", false, "", false
		}
		s = text[1 : 1+end]
		p.out = appendJSONString(p.out, s)
		return s, true, text[2+end:], true
	case '\'':
		end := strings.IndexByte(text[1:], '\'')
		if end < 0 || (2+end < len(text) && text[2+end] == '\'') { // '' is a quote: left to the parser
			return "", false, "", false
		}
		s = text[1 : 1+end]
		p.out = appendJSONString(p.out, s)
		return s, true, text[2+end:], true
	}
	n := len(text)
	if inFlow {
		n = strings.IndexAny(text, ",]}")
		if n < 0 {
			return "", false, "", false
		}
	}
	s, rest = strings.TrimRight(text[:n], " "), text[n:]
	switch {
	case s == "":
		return "", false, "", false
	case isDigit(s[0]):
		if integer(s) {
			p.out = append(p.out, s...)
			return "", false, rest, true
		}
		if !dotted(s) && !unit(s) {
			return "", false, "", false
		}
	case !isLetter(s[0]):
		return "", false, "", false
	case s == "true" || s == "false":
		p.out = append(p.out, s...)
		return "", false, rest, true
	case special(s):
		return "", false, "", false
	default:
		for i := 1; i < len(s); i++ {
			c := s[i]
			if !isLetter(c) && !isDigit(c) && strings.IndexByte("._/-: ", c) < 0 || c == ':' && (inFlow || i+1 == len(s) || s[i+1] == ' ') {
				return "", false, "", false
			}
		}
	}
	p.out = appendJSONString(p.out, s)
	return s, true, rest, true
}

// integer reports a decimal integer YAML reads as one (no sign, no leading zero, no "_"), short
// enough for any integer type.
func integer(s string) bool {
	if len(s) > 18 || (len(s) > 1 && s[0] == '0') {
		return false
	}
	for i := range len(s) {
		if !isDigit(s[i]) {
			return false
		}
	}
	return true
}

// dotted reports digits with two dots or more (an IPv4 address, a version): no number or
// timestamp, so a string.
func dotted(s string) bool {
	dots := 0
	for i := range len(s) {
		switch {
		case s[i] == '.':
			dots++
		case !isDigit(s[i]):
			return false
		}
	}
	return dots >= 2
}

// plainASCII reports printable ASCII only: no tab, no control character (which the parser
// rejects), nothing that must be valid UTF-8.
func plainASCII(s string) bool {
	for i := range len(s) {
		if s[i] < 0x20 || s[i] >= 0x7f {
			return false
		}
	}
	return true
}

// unit reports digits followed by letters that no number syntax uses ("5s", "30m", "10Mi"), so a
// string: no exponent (e), base (x, o, b) or hexadecimal float (p) letter.
func unit(s string) bool {
	letters := false
	for i := range len(s) {
		switch c := s[i]; {
		case isDigit(c):
			if letters {
				return false
			}
		case isLetter(c) && strings.IndexByte("eExXoObBpP", c) < 0:
			letters = true
		default:
			return false
		}
	}
	return letters
}
