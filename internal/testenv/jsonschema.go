package testenv

import (
	"bytes"
	"fmt"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// JSONSchema is a compiled JSON schema (draft 2020-12 unless the file says otherwise), for tests
// that check documented formats (the access log's) against what the code writes.
type JSONSchema struct{ s *jsonschema.Schema }

// LoadJSONSchema compiles the schema in file, asserting "format" keywords (date-time).
func LoadJSONSchema(file string) (*JSONSchema, error) {
	c := jsonschema.NewCompiler()
	c.AssertFormat()
	s, err := c.Compile(file)
	if err != nil {
		return nil, fmt.Errorf("compile %s: %w", file, err)
	}
	return &JSONSchema{s}, nil
}

// Validate checks one JSON document; the error lists every violation with its path.
func (s *JSONSchema) Validate(doc []byte) error {
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(doc))
	if err != nil {
		return fmt.Errorf("not JSON: %w", err)
	}
	if err := s.s.Validate(v); err != nil {
		return fmt.Errorf("%s: %w", bytes.TrimSpace(doc), err)
	}
	return nil
}
