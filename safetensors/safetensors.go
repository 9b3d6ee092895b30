// Package safetensors reads and writes the safetensors file format of Hugging
// Face (an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the raw little-endian data), and
// converts the floating-point dtypes checkpoints use (F32, BF16, F16, F64) to
// and from float32. It owns the format only; which tensors a model has is the
// business of its package (train/hfmoe).
package safetensors

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sort"
)

// Tensor is one named tensor of a file: its dtype ("F32", "BF16", ...),
// shape, and raw little-endian bytes.
type Tensor struct {
	DType string
	Shape []int
	Data  []byte
}

// Numel is the number of elements of the shape.
func (t Tensor) Numel() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// File is a parsed safetensors file.
type File struct {
	Tensors  map[string]Tensor
	Metadata map[string]string
}

// Names returns the tensor names in sorted order.
func (f *File) Names() []string {
	names := make([]string, 0, len(f.Tensors))
	for n := range f.Tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

type entry struct {
	DType   string `json:"dtype"`
	Shape   []int  `json:"shape"`
	Offsets [2]int `json:"data_offsets"`
}

var dtypeSize = map[string]int{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
	"I16": 2, "U16": 2, "F16": 2, "BF16": 2,
	"I32": 4, "U32": 4, "F32": 4,
	"I64": 8, "U64": 8, "F64": 8,
}

// maxHeader bounds the JSON header (the format's own reference limit is 100 MB).
const maxHeader = 100 << 20

// ReadFile reads and parses a whole safetensors file.
func ReadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("safetensors: %w", err)
	}
	f, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("safetensors: %s: %w", path, err)
	}
	return f, nil
}

// Parse parses a safetensors file held in b; the tensors' Data alias b.
func Parse(b []byte) (*File, error) {
	if len(b) < 8 {
		return nil, fmt.Errorf("%d bytes: too short for a header", len(b))
	}
	n := binary.LittleEndian.Uint64(b)
	if n > maxHeader || n > uint64(len(b)-8) {
		return nil, fmt.Errorf("header of %d bytes in a file of %d", n, len(b))
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &raw); err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	data := b[8+n:]
	f := &File{Tensors: make(map[string]Tensor, len(raw))}
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &f.Metadata); err != nil {
				return nil, fmt.Errorf("metadata: %w", err)
			}
			continue
		}
		var e entry
		if err := json.Unmarshal(msg, &e); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		size, ok := dtypeSize[e.DType]
		if !ok {
			return nil, fmt.Errorf("tensor %q: unknown dtype %q", name, e.DType)
		}
		numel := 1
		for _, d := range e.Shape {
			if d < 0 || (d > 0 && numel > math.MaxInt32*64/d) {
				return nil, fmt.Errorf("tensor %q: bad shape %v", name, e.Shape)
			}
			numel *= d
		}
		lo, hi := e.Offsets[0], e.Offsets[1]
		if lo < 0 || hi < lo || hi > len(data) || hi-lo != numel*size {
			return nil, fmt.Errorf("tensor %q: offsets %v for %d elements of %s in %d data bytes", name, e.Offsets, numel, e.DType, len(data))
		}
		f.Tensors[name] = Tensor{DType: e.DType, Shape: e.Shape, Data: data[lo:hi:hi]}
	}
	return f, nil
}

// Float32s converts a floating-point tensor to float32 (exactly for F32,
// BF16 and F16; F64 is rounded to nearest).
func (t Tensor) Float32s() ([]float32, error) {
	n := t.Numel()
	out := make([]float32, n)
	d := t.Data
	switch t.DType {
	case "F32":
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(d[4*i:]))
		}
	case "BF16":
		for i := range out {
			out[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(d[2*i:])) << 16)
		}
	case "F16":
		for i := range out {
			out[i] = halfToFloat(binary.LittleEndian.Uint16(d[2*i:]))
		}
	case "F64":
		for i := range out {
			out[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(d[8*i:])))
		}
	default:
		return nil, fmt.Errorf("dtype %s is not a float", t.DType)
	}
	return out, nil
}

// Int64s converts an integer tensor (I64, I32, I16, I8, U8) to int64.
func (t Tensor) Int64s() ([]int64, error) {
	n := t.Numel()
	out := make([]int64, n)
	d := t.Data
	switch t.DType {
	case "I64":
		for i := range out {
			out[i] = int64(binary.LittleEndian.Uint64(d[8*i:]))
		}
	case "I32":
		for i := range out {
			out[i] = int64(int32(binary.LittleEndian.Uint32(d[4*i:])))
		}
	case "I16":
		for i := range out {
			out[i] = int64(int16(binary.LittleEndian.Uint16(d[2*i:])))
		}
	case "I8":
		for i := range out {
			out[i] = int64(int8(d[i]))
		}
	case "U8":
		for i := range out {
			out[i] = int64(d[i])
		}
	default:
		return nil, fmt.Errorf("dtype %s is not an integer type", t.DType)
	}
	return out, nil
}

// halfToFloat converts an IEEE binary16 value to float32 exactly.
func halfToFloat(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf or NaN
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp == 0 && man == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal: man * 2^-24
		v := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			v = -v
		}
		return v
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

// F32 makes a float32 tensor of the given shape (the data is copied).
func F32(shape []int, v []float32) Tensor {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return Tensor{DType: "F32", Shape: slices.Clone(shape), Data: b}
}

// BF16 makes a bfloat16 tensor of the given shape, rounding each float32 to
// nearest even as torch's conversion does (NaN stays a quiet NaN).
func BF16(shape []int, v []float32) Tensor {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], toBF16(x))
	}
	return Tensor{DType: "BF16", Shape: slices.Clone(shape), Data: b}
}

func toBF16(x float32) uint16 {
	u := math.Float32bits(x)
	if x != x {
		return uint16(u>>16) | 0x40
	}
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}

// I64 makes an int64 tensor of the given shape.
func I64(shape []int, v []int64) Tensor {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(x))
	}
	return Tensor{DType: "I64", Shape: slices.Clone(shape), Data: b}
}

// Write writes tensors to w as a safetensors file, in sorted name order (as
// the Python library lays them out), with the given metadata (may be nil).
func Write(w io.Writer, tensors map[string]Tensor, metadata map[string]string) error {
	names := make([]string, 0, len(tensors))
	for n := range tensors {
		if n == "__metadata__" {
			return fmt.Errorf("safetensors: a tensor may not be named __metadata__")
		}
		names = append(names, n)
	}
	sort.Strings(names)
	header := make(map[string]any, len(tensors)+1)
	if len(metadata) > 0 {
		header["__metadata__"] = metadata
	}
	off := 0
	for _, n := range names {
		t := tensors[n]
		size, ok := dtypeSize[t.DType]
		if !ok {
			return fmt.Errorf("safetensors: tensor %q: unknown dtype %q", n, t.DType)
		}
		if len(t.Data) != t.Numel()*size {
			return fmt.Errorf("safetensors: tensor %q: %d bytes for shape %v of %s", n, len(t.Data), t.Shape, t.DType)
		}
		shape := t.Shape
		if shape == nil {
			shape = []int{}
		}
		header[n] = entry{DType: t.DType, Shape: shape, Offsets: [2]int{off, off + len(t.Data)}}
		off += len(t.Data)
	}
	hb, err := json.Marshal(header)
	if err != nil {
		return fmt.Errorf("safetensors: header: %w", err)
	}
	// Pad the header with spaces to a multiple of 8 bytes, as the reference
	// writer does, so that the data starts aligned.
	for (8+len(hb))%8 != 0 {
		hb = append(hb, ' ')
	}
	var lenb [8]byte
	binary.LittleEndian.PutUint64(lenb[:], uint64(len(hb)))
	if _, err := w.Write(lenb[:]); err != nil {
		return fmt.Errorf("safetensors: %w", err)
	}
	if _, err := w.Write(hb); err != nil {
		return fmt.Errorf("safetensors: %w", err)
	}
	for _, n := range names {
		if _, err := w.Write(tensors[n].Data); err != nil {
			return fmt.Errorf("safetensors: %w", err)
		}
	}
	return nil
}

// WriteFile writes tensors to path (see Write), through a temporary file
// renamed into place.
func WriteFile(path string, tensors map[string]Tensor, metadata map[string]string) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return fmt.Errorf("safetensors: %w", err)
	}
	if err := Write(f, tensors, metadata); err != nil {
		f.Close()
		os.Remove(tmp)
		return err
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("safetensors: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("safetensors: %w", err)
	}
	return nil
}

// F64 makes a float64 tensor of the given shape.
func F64(shape []int, v []float64) Tensor {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(b[8*i:], math.Float64bits(x))
	}
	return Tensor{DType: "F64", Shape: slices.Clone(shape), Data: b}
}
