package ipc

import (
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// FuzzDecode feeds arbitrary bytes to the envelope decoder and every body
// decoder with its validation: nothing may panic, and whatever decodes
// without error must have passed validation.
//
//	go test -fuzz=FuzzDecode -fuzztime=10m ./ipc/
func FuzzDecode(f *testing.F) {
	for _, seed := range []any{
		Request{V: Version, Op: OpStats, ID: 1},
		map[string]any{"v": 1, "op": "step", "id": 2, "body": map[string]any{"items": []any{map[string]any{"tensor": 1, "apply": true}}}},
		map[string]any{"v": 1, "op": "register", "id": 3, "body": map[string]any{"tensors": []any{map[string]any{"name": "w", "shape": []int{4, 4}, "dtype": "float32"}}}},
		[]any{1, 2, 3},
		"not a map",
	} {
		b, err := msgpack.Marshal(seed)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0xc1})
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := DecodeRequest(data)
		if err != nil {
			return
		}
		bodies := []any{&Hello{}, &Attach{}, &Register{}, &Step{}, &StateXfer{}, &Detach{}}
		for _, b := range bodies {
			if err := DecodeBody(req, b); err != nil {
				continue
			}
			if v, ok := b.(interface{ Validate() error }); ok {
				if err := v.Validate(); err != nil {
					t.Fatalf("DecodeBody accepted a body that fails Validate: %v", err)
				}
			}
		}
	})
}
