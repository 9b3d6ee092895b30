package ipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"
)

// errMalformed stops CheckIntRanges on input the decoder itself will refuse
// (with a better message).
var errMalformed = errors.New("malformed")

// CheckIntRanges walks the msgpack value b along the Go type t it is about
// to be decoded into and refuses an integer that does not fit its field:
// msgpack's decoder converts silently, so a u32 field sent 2^32+n became n
// and a negative number sent for a u64 became a huge one. The error names
// the field ("items[0].tensor"). Input that is malformed in any other way is
// left to the decoder. It reads b in place and allocates nothing unless it
// refuses.
func CheckIntRanges(b []byte, t reflect.Type) error {
	sc := schemaOf(t)
	if sc == nil {
		return nil
	}
	var path [8]pathElem
	w := intWalker{b: b, path: path[:0]}
	_, err := w.walk(0, sc)
	if errors.Is(err, errMalformed) {
		return nil
	}
	return err
}

// pathElem is one step of the path to the value being checked: a map key,
// or an array index when key is nil.
type pathElem struct {
	key []byte
	idx int
}

type intWalker struct {
	b    []byte
	path []pathElem
}

func (w *intWalker) pathString() string {
	var sb strings.Builder
	for _, e := range w.path {
		if e.key == nil {
			fmt.Fprintf(&sb, "[%d]", e.idx)
			continue
		}
		if sb.Len() > 0 {
			sb.WriteByte('.')
		}
		sb.Write(e.key)
	}
	return sb.String()
}

// skipValue is the offset past the value at i (errMalformed when there is none).
func (w *intWalker) skipValue(i int) (int, error) {
	j, err := skip(w.b, i, 0)
	if err != nil {
		return 0, errMalformed
	}
	return j, nil
}

// header reads a map (pairs) or array header at i: its element count and the
// offset of the first element; ok false when the value is not one.
func (w *intWalker) header(i int, isMap bool) (n, j int, ok bool) {
	c := w.b[i]
	fix, w16, w32 := byte(0x90), byte(0xdc), byte(0xdd)
	if isMap {
		fix, w16, w32 = 0x80, 0xde, 0xdf
	}
	switch {
	case c >= fix && c <= fix+0x0f:
		return int(c & 0x0f), i + 1, true
	case c == w16 && i+3 <= len(w.b):
		return int(binary.BigEndian.Uint16(w.b[i+1:])), i + 3, true
	case c == w32 && i+5 <= len(w.b):
		return int(binary.BigEndian.Uint32(w.b[i+1:])), i + 5, true
	}
	return 0, 0, false
}

// str reads a string at i.
func (w *intWalker) str(i int) (s []byte, j int, ok bool) {
	c := w.b[i]
	var n int
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n, j = int(c&0x1f), i+1
	case c == 0xd9 && i+2 <= len(w.b):
		n, j = int(w.b[i+1]), i+2
	case c == 0xda && i+3 <= len(w.b):
		n, j = int(binary.BigEndian.Uint16(w.b[i+1:])), i+3
	case c == 0xdb && i+5 <= len(w.b):
		n, j = int(binary.BigEndian.Uint32(w.b[i+1:])), i+5
	default:
		return nil, 0, false
	}
	if n > len(w.b)-j {
		return nil, 0, false
	}
	return w.b[j : j+n], j + n, true
}

func (w *intWalker) walk(i int, n *schema) (int, error) {
	if i >= len(w.b) {
		return 0, errMalformed
	}
	switch {
	case len(n.fields) > 0:
		cnt, j, ok := w.header(i, true)
		if !ok {
			return w.skipValue(i) // nil, or not a map: the decoder says what is wrong
		}
		for range cnt {
			if j >= len(w.b) {
				return 0, errMalformed
			}
			key, k, ok := w.str(j)
			if !ok {
				return 0, errMalformed
			}
			var f *schema
			for _, c := range n.fields { // few: a linear scan beats hashing
				if c.key == string(key) {
					f = c.s
					break
				}
			}
			var err error
			if f == nil { // an unknown key, or a field without integers
				j, err = w.skipValue(k)
			} else {
				w.path = append(w.path, pathElem{key: key})
				j, err = w.walk(k, f)
				w.path = w.path[:len(w.path)-1]
			}
			if err != nil {
				return 0, err
			}
		}
		return j, nil
	case n.elem != nil:
		cnt, j, ok := w.header(i, false)
		if !ok {
			return w.skipValue(i)
		}
		for k := range cnt {
			var err error
			w.path = append(w.path, pathElem{idx: k})
			j, err = w.walk(j, n.elem)
			w.path = w.path[:len(w.path)-1]
			if err != nil {
				return 0, err
			}
		}
		return j, nil
	case n.bits > 0:
		return w.checkInt(i, n)
	}
	return w.skipValue(i)
}

// checkInt reads the integer at i, if it is one, and checks it against the
// range of t.
func (w *intWalker) checkInt(i int, t *schema) (int, error) {
	b := w.b
	c := b[i]
	var mag uint64 // the value, as unsigned (or as int64 bits when isSigned)
	var isSigned bool
	var j int
	left := len(b) - i - 1
	switch {
	case c <= 0x7f:
		mag, j = uint64(c), i+1
	case c >= 0xe0:
		mag, j, isSigned = uint64(int64(int8(c))), i+1, true
	case c == 0xcc && left >= 1:
		mag, j = uint64(b[i+1]), i+2
	case c == 0xcd && left >= 2:
		mag, j = uint64(binary.BigEndian.Uint16(b[i+1:])), i+3
	case c == 0xce && left >= 4:
		mag, j = uint64(binary.BigEndian.Uint32(b[i+1:])), i+5
	case c == 0xcf && left >= 8:
		mag, j = binary.BigEndian.Uint64(b[i+1:]), i+9
	case c == 0xd0 && left >= 1:
		mag, j, isSigned = uint64(int64(int8(b[i+1]))), i+2, true
	case c == 0xd1 && left >= 2:
		mag, j, isSigned = uint64(int64(int16(binary.BigEndian.Uint16(b[i+1:])))), i+3, true
	case c == 0xd2 && left >= 4:
		mag, j, isSigned = uint64(int64(int32(binary.BigEndian.Uint32(b[i+1:])))), i+5, true
	case c == 0xd3 && left >= 8:
		mag, j, isSigned = binary.BigEndian.Uint64(b[i+1:]), i+9, true
	default:
		return w.skipValue(i) // not an integer: the decoder refuses it
	}
	neg := isSigned && int64(mag) < 0
	if neg {
		mag = uint64(-(int64(mag) + 1)) + 1 // |value|
	}
	bits, unsigned := t.bits, t.unsigned
	var hi uint64
	var ok bool
	if unsigned {
		hi = math.MaxUint64 >> (64 - bits)
		ok = !neg && mag <= hi
	} else {
		hi = math.MaxInt64 >> (64 - bits)
		ok = (!neg && mag <= hi) || (neg && mag <= hi+1)
	}
	if ok {
		return j, nil
	}
	lo := "0"
	if !unsigned {
		lo = fmt.Sprintf("-%d", hi+1)
	}
	val := fmt.Sprint(mag)
	if neg {
		val = "-" + val
	}
	return 0, fmt.Errorf("field %s: %s out of range for %s (%s..%d)", w.pathString(), val, t.name, lo, hi)
}

// schema is what CheckIntRanges needs of a Go type: the integer fields, and
// the structs and arrays that lead to them (nil: nothing to check).
type schema struct {
	fields   []field // a struct: its msgpack keys that lead to integers
	elem     *schema // a slice or array of integers or of such structs
	bits     int     // an integer of this many bits
	unsigned bool
	name     string // as docs/protocol.md names it: u32, u64, int
}

type field struct {
	key string
	s   *schema
}

var schemas sync.Map // reflect.Type -> *schema

func schemaOf(t reflect.Type) *schema {
	if s, ok := schemas.Load(t); ok {
		return s.(*schema)
	}
	s := compile(t, 0)
	schemas.Store(t, s)
	return s
}

func compile(t reflect.Type, depth int) *schema {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if depth > MaxDepth {
		return nil
	}
	switch k := t.Kind(); {
	case k == reflect.Struct:
		var fields []field
		for i := range t.NumField() {
			f := t.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("msgpack"), ",")
			if !f.IsExported() || name == "-" {
				continue
			}
			if name == "" {
				name = f.Name
			}
			if s := compile(f.Type, depth+1); s != nil {
				fields = append(fields, field{name, s})
			}
		}
		if len(fields) == 0 {
			return nil
		}
		return &schema{fields: fields}
	case (k == reflect.Slice || k == reflect.Array) && t.Elem().Kind() != reflect.Uint8:
		if e := compile(t.Elem(), depth+1); e != nil {
			return &schema{elem: e}
		}
	case k >= reflect.Int && k <= reflect.Int64:
		name := k.String()
		if k == reflect.Int || k == reflect.Int64 {
			name = "int"
		}
		return &schema{bits: t.Bits(), name: name}
	case k >= reflect.Uint && k <= reflect.Uint64:
		name := k.String()
		switch k {
		case reflect.Uint32:
			name = "u32"
		case reflect.Uint64:
			name = "u64"
		}
		return &schema{bits: t.Bits(), unsigned: true, name: name}
	}
	return nil
}
