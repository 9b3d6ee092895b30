package ipc

import (
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func TestCheckMsgpack(t *testing.T) {
	good, err := msgpack.Marshal(map[string]any{"v": 1, "op": "step", "id": uint64(1) << 40, "body": map[string]any{
		"items": []any{map[string]any{"f": 1.5, "f32": float32(2), "b": []byte("xyz"), "neg": -300, "t": true, "n": nil}}}})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		in   []byte
		want string // substring of the error; "" = valid
	}{
		{"valid nested message", good, ""},
		{"fixint", []byte{0x05}, ""},
		{"empty", nil, "ends early"},
		{"bin32 claims 3 GB", []byte{0xc6, 0xc6, 0xc6, 0xc6, 0xc6, 1, 2}, "exceeds"},
		{"map32 claims 800M entries", []byte{0xdf, 0x30, 0x30, 0x30, 0x30, 0xc0}, "exceeds"},
		{"array16 longer than message", []byte{0xdc, 0x00, 0x04, 0xc0, 0xc0}, "cannot fit"},
		{"str8 past end", []byte{0xd9, 0x03, 0x61, 0x62}, "runs past"},
		{"ext32 huge", []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0x01}, "exceeds"},
		{"never-used byte", []byte{0xc1}, "invalid msgpack byte"},
		{"trailing bytes", []byte{0xc0, 0xc0}, "trailing"},
		{"length cut off", []byte{0xcd, 0x01}, "runs past"},
		{"deep nesting", []byte(strings.Repeat("\x91", MaxDepth+1) + "\xc0"), "nested deeper"},
		{"nesting at limit", []byte(strings.Repeat("\x91", MaxDepth) + "\xc0"), ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := CheckMsgpack(c.in)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("rejected a valid message: %v", err)
			case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
				t.Fatalf("got %v, want an error containing %q", err, c.want)
			}
		})
	}
}
