package ipc

import (
	"encoding/binary"
	"fmt"
)

// MaxDepth bounds the nesting of containers in a message.
const MaxDepth = 16

// CheckMsgpack walks b as one msgpack object without allocating, and
// rejects it unless every declared length fits in the bytes that are
// actually there, containers nest at most MaxDepth deep, and nothing
// follows the object. Decoders allocate by the lengths a message declares,
// so without this check a 14-byte message claiming a 3 GB binary field makes
// the server allocate 3 GB.
func CheckMsgpack(b []byte) error {
	n, err := skip(b, 0, 0)
	if err != nil {
		return err
	}
	if n != len(b) {
		return fmt.Errorf("%d trailing bytes after the message", len(b)-n)
	}
	return nil
}

// skip returns the offset just past the object at b[i:].
func skip(b []byte, i, depth int) (int, error) {
	if i >= len(b) {
		return 0, fmt.Errorf("message ends early at byte %d", i)
	}
	c := b[i]
	i++
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return i, nil
	case c >= 0xa0 && c <= 0xbf:
		return span(b, i, int(c&0x1f))
	case c >= 0x80 && c <= 0x8f:
		return items(b, i, 2*int(c&0x0f), depth)
	case c >= 0x90 && c <= 0x9f:
		return items(b, i, int(c&0x0f), depth)
	}
	switch c {
	case 0xcc, 0xd0:
		return span(b, i, 1)
	case 0xcd, 0xd1:
		return span(b, i, 2)
	case 0xca, 0xce, 0xd2:
		return span(b, i, 4)
	case 0xcb, 0xcf, 0xd3:
		return span(b, i, 8)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext: type byte + 1, 2, 4, 8, 16
		return span(b, i, 1+(1<<(c-0xd4)))
	case 0xc4, 0xd9: // bin8, str8
		return sized(b, i, 1, 0)
	case 0xc5, 0xda:
		return sized(b, i, 2, 0)
	case 0xc6, 0xdb:
		return sized(b, i, 4, 0)
	case 0xc7: // ext8/16/32: length, then a type byte
		return sized(b, i, 1, 1)
	case 0xc8:
		return sized(b, i, 2, 1)
	case 0xc9:
		return sized(b, i, 4, 1)
	case 0xdc, 0xdd, 0xde, 0xdf:
		w := 2
		if c == 0xdd || c == 0xdf {
			w = 4
		}
		n, j, err := length(b, i, w)
		if err != nil {
			return 0, err
		}
		if c >= 0xde {
			n *= 2
		}
		return items(b, j, n, depth)
	}
	return 0, fmt.Errorf("invalid msgpack byte 0x%02x at %d", c, i-1)
}

func span(b []byte, i, n int) (int, error) {
	if n < 0 || n > len(b)-i {
		return 0, fmt.Errorf("field of %d bytes at %d runs past the %d-byte message", n, i, len(b))
	}
	return i + n, nil
}

func length(b []byte, i, w int) (int, int, error) {
	if w > len(b)-i {
		return 0, 0, fmt.Errorf("message ends inside a length at %d", i)
	}
	var n uint64
	switch w {
	case 1:
		n = uint64(b[i])
	case 2:
		n = uint64(binary.BigEndian.Uint16(b[i:]))
	case 4:
		n = uint64(binary.BigEndian.Uint32(b[i:]))
	}
	if n > uint64(len(b)) {
		return 0, 0, fmt.Errorf("declared length %d at %d exceeds the %d-byte message", n, i, len(b))
	}
	return int(n), i + w, nil
}

func sized(b []byte, i, w, extra int) (int, error) {
	n, j, err := length(b, i, w)
	if err != nil {
		return 0, err
	}
	return span(b, j, n+extra)
}

func items(b []byte, i, n, depth int) (int, error) {
	if depth >= MaxDepth {
		return 0, fmt.Errorf("containers nested deeper than %d", MaxDepth)
	}
	if n > len(b)-i { // every element takes at least one byte
		return 0, fmt.Errorf("container of %d elements at %d cannot fit in the %d-byte message", n, i, len(b))
	}
	var err error
	for k := 0; k < n; k++ {
		if i, err = skip(b, i, depth+1); err != nil {
			return 0, err
		}
	}
	return i, nil
}
