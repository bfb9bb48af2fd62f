// Package atomicfile replaces a file so that a reader, or a writer killed midway, sees either the
// old content or the new one: the state files the proxy reads back after a restart (the bind
// state file, the restart snapshot) are written through it.
package atomicfile

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Write writes a temporary file beside path (mode 0600, named tempPrefix followed by a random
// suffix) with write, then renames it over path. On any failure the temporary file is removed and
// path is left as it was.
func Write(path, tempPrefix string, write func(io.Writer) error) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), tempPrefix+"*")
	if err != nil {
		return fmt.Errorf("create temporary file: %w", err)
	}
	name := tmp.Name()
	err = write(tmp)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(name, path)
	}
	if err != nil {
		_ = os.Remove(name)
		return fmt.Errorf("write: %w", err)
	}
	return nil
}
