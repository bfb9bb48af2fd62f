package flow

import (
	"fmt"
	"reflect"
	"regexp"
	"testing"
)

// TestStatsAddSumsEveryField: a field added to Stats but forgotten in Add would make a bind-mode
// service port (several sockets) under-report it.
func TestStatsAddSumsEveryField(t *testing.T) {
	var one Stats
	v := reflect.ValueOf(&one).Elem()
	for i := range v.NumField() {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.Array:
			for j := range f.Len() {
				f.Index(j).SetUint(1)
			}
		case reflect.Int64:
			f.SetInt(1)
		default:
			f.SetUint(1)
		}
	}
	sum := one
	sum.Add(one)
	s := reflect.ValueOf(sum)
	for i := range s.NumField() {
		f, name := s.Field(i), s.Type().Field(i).Name
		switch f.Kind() {
		case reflect.Array:
			for j := range f.Len() {
				if f.Index(j).Uint() != 2 {
					t.Errorf("%s[%v] = %d after adding 1 to 1, want 2", name, EndReason(j), f.Index(j).Uint())
				}
			}
		case reflect.Int64:
			if f.Int() != 2 {
				t.Errorf("%s = %d after adding 1 to 1, want 2", name, f.Int())
			}
		default:
			if f.Uint() != 2 {
				t.Errorf("%s = %d after adding 1 to 1, want 2", name, f.Uint())
			}
		}
	}
}

// TestEndReasonSpelling: one scheme for every reason (lower case, words joined by '-'), and no two
// reasons alike, since the access log and the debug views print them.
func TestEndReasonSpelling(t *testing.T) {
	scheme := regexp.MustCompile(`^[a-z]+(-[a-z]+)*$`)
	seen := map[string]EndReason{}
	for r := range NumEndReasons {
		name := r.String()
		if !scheme.MatchString(name) {
			t.Errorf("EndReason(%d) = %q, want lower-case words joined by '-'", r, name)
		}
		if prev, ok := seen[name]; ok {
			t.Errorf("EndReason(%d) and EndReason(%d) are both %q", prev, r, name)
		}
		seen[name] = r
	}
	if got, want := NumEndReasons.String(), fmt.Sprintf("EndReason(%d)", uint8(NumEndReasons)); got != want {
		t.Errorf("out of range: %q, want %s", got, want)
	}
}
