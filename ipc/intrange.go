package ipc

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// errMalformed stops CheckIntRanges on input the decoder itself will refuse
// (with a better message).
var errMalformed = errors.New("malformed")

// CheckIntRanges walks the msgpack value b along the Go type t it is about
// to be decoded into and refuses an integer that does not fit its field:
// msgpack's decoder converts silently, so a u32 field sent 2^32+n became n
// and a negative number sent for a u64 became a huge one. The error names
// the field ("items[0].tensor"). Input that is malformed in any other way is
// left to the decoder.
func CheckIntRanges(b []byte, t reflect.Type) error {
	err := walkInts(msgpack.NewDecoder(bytes.NewReader(b)), t, "")
	if errors.Is(err, errMalformed) {
		return nil
	}
	return err
}

func walkInts(d *msgpack.Decoder, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	c, err := d.PeekCode()
	if err != nil {
		return errMalformed
	}
	if c == msgpcode.Nil {
		return skipValue(d)
	}
	switch t.Kind() {
	case reflect.Struct:
		if !msgpcode.IsFixedMap(c) && c != msgpcode.Map16 && c != msgpcode.Map32 {
			return skipValue(d)
		}
		n, err := d.DecodeMapLen()
		if err != nil {
			return errMalformed
		}
		fields := fieldsOf(t)
		for range n {
			key, err := d.DecodeString()
			if err != nil {
				return errMalformed
			}
			ft, ok := fields[key]
			if !ok {
				if err := skipValue(d); err != nil {
					return err
				}
				continue
			}
			if err := walkInts(d, ft, join(path, key)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Slice, reflect.Array:
		if t.Elem().Kind() == reflect.Uint8 || (!msgpcode.IsFixedArray(c) && c != msgpcode.Array16 && c != msgpcode.Array32) {
			return skipValue(d) // bytes, or not an array: the decoder says what is wrong
		}
		n, err := d.DecodeArrayLen()
		if err != nil {
			return errMalformed
		}
		for i := range n {
			if err := walkInts(d, t.Elem(), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return checkInt(d, c, t, path)
	}
	return skipValue(d)
}

func skipValue(d *msgpack.Decoder) error {
	if err := d.Skip(); err != nil {
		return errMalformed
	}
	return nil
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// checkInt reads one integer and checks it against the range of t.
func checkInt(d *msgpack.Decoder, c byte, t reflect.Type, path string) error {
	var neg bool
	var mag uint64 // |value|
	switch {
	case c == msgpcode.Uint64:
		v, err := d.DecodeUint64()
		if err != nil {
			return errMalformed
		}
		mag = v
	case msgpcode.IsFixedNum(c) || (c >= msgpcode.Uint8 && c <= msgpcode.Int64):
		v, err := d.DecodeInt64()
		if err != nil {
			return errMalformed
		}
		neg, mag = v < 0, uint64(v)
		if neg {
			mag = uint64(-(v + 1)) + 1
		}
	default:
		return skipValue(d) // not an integer: the decoder refuses it
	}
	bits := t.Bits()
	var lo string
	var ok bool
	var hi uint64
	switch t.Kind() {
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		hi, lo = math.MaxUint64>>(64-bits), "0"
		ok = !neg && mag <= hi
	default:
		hi = math.MaxInt64 >> (64 - bits)
		lo = fmt.Sprintf("-%d", hi+1)
		ok = (!neg && mag <= hi) || (neg && mag <= hi+1)
	}
	if ok {
		return nil
	}
	val := fmt.Sprint(mag)
	if neg {
		val = "-" + val
	}
	return fmt.Errorf("field %s: %s out of range for %s (%s..%d)", path, val, wireType(t), lo, hi)
}

// wireType names t as docs/protocol.md does.
func wireType(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Uint32:
		return "u32"
	case reflect.Uint64:
		return "u64"
	case reflect.Int, reflect.Int64:
		return "int"
	}
	return t.Kind().String()
}

var fieldCache sync.Map // reflect.Type -> map[string]reflect.Type

// fieldsOf maps the msgpack keys of struct t to their field types.
func fieldsOf(t reflect.Type) map[string]reflect.Type {
	if m, ok := fieldCache.Load(t); ok {
		return m.(map[string]reflect.Type)
	}
	m := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("msgpack"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		m[name] = f.Type
	}
	fieldCache.Store(t, m)
	return m
}
