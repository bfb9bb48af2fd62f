package loglevel

import (
	"testing"

	"github.com/sirupsen/logrus"
)

func TestDebug(t *testing.T) {
	l := logrus.New()
	l.SetLevel(logrus.InfoLevel)
	if Debug(l) || Debug(l.WithField("k", "v")) {
		t.Error("an info-level logger said it writes debug lines")
	}
	l.SetLevel(logrus.DebugLevel)
	if !Debug(l) || !Debug(l.WithField("k", "v")) {
		t.Error("a debug-level logger said it does not write debug lines")
	}
}
