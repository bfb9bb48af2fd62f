// Package loglevel says whether a logrus logger would write a level, so that a hot path builds
// a log entry (fields, maps) only when it would be written.
package loglevel

import "github.com/sirupsen/logrus"

// Debug reports whether l writes debug lines: a logrus Logger or Entry at that level; any other
// FieldLogger (a test's) is taken to.
func Debug(l logrus.FieldLogger) bool {
	switch l := l.(type) {
	case *logrus.Logger:
		return l.IsLevelEnabled(logrus.DebugLevel)
	case *logrus.Entry:
		return l.Logger.IsLevelEnabled(logrus.DebugLevel)
	}
	return true
}
