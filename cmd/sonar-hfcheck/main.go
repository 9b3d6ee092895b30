// Command sonar-hfcheck runs the Go OLMoE or GraniteMoe (package
// train/hfmoe) once, forward and backward, on a Hugging Face checkpoint and
// a batch of token ids, and writes what transformers would compute to
// compare: logits, loss and every parameter's gradient. tests/test_go_hfmoe.py runs it against
// transformers' fp32 eager forward and backward on the same weights.
//
//	sonar-hfcheck --model DIR --inputs IN.safetensors --out OUT.safetensors [--save DIR2] [--f64]
//
// IN holds "input_ids" [B, S] (any integer dtype) and optionally "labels"
// [B, S] (default: the inputs; -100 not counted), with transformers'
// meaning: position s predicts labels[s+1]. OUT holds "logits" [B, S, V],
// "loss", "ce", "aux" (float64 scalars as [1]) and "grad.NAME" for every
// parameter, named as the model's named_parameters() names them in
// transformers 5.x (expert tensors batched: "...mlp.experts.gate_up_proj").
// With --save the loaded weights are written back as a checkpoint to DIR2.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/sonar-moe/sonar/safetensors"
	"github.com/sonar-moe/sonar/train/hfmoe"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "sonar-hfcheck:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("sonar-hfcheck", flag.ContinueOnError)
	modelDir := fs.String("model", "", "save_pretrained directory of an OlmoeForCausalLM or GraniteMoeForCausalLM")
	inputs := fs.String("inputs", "", "safetensors file with input_ids [B, S] and optionally labels [B, S]")
	out := fs.String("out", "", "safetensors file to write logits, losses and gradients to")
	save := fs.String("save", "", "also write the loaded model back as a checkpoint to this directory")
	f64 := fs.Bool("f64", false, "compute in float64 instead of float32")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *modelDir == "" || *inputs == "" || *out == "" {
		return fmt.Errorf("--model, --inputs and --out are required")
	}
	ids, labels, b, s, err := readBatch(*inputs)
	if err != nil {
		return err
	}
	if *f64 {
		return check[float64](*modelDir, *save, *out, ids, labels, b, s)
	}
	return check[float32](*modelDir, *save, *out, ids, labels, b, s)
}

// readBatch reads input_ids and labels (default: input_ids) [B, S] and
// returns the inputs and the next-token targets of each position.
func readBatch(path string) (inputs, targets []int32, b, s int, err error) {
	f, err := safetensors.ReadFile(path)
	if err != nil {
		return nil, nil, 0, 0, err
	}
	it, ok := f.Tensors["input_ids"]
	if !ok || len(it.Shape) != 2 {
		return nil, nil, 0, 0, fmt.Errorf("%s: want a tensor input_ids [B, S]", path)
	}
	b, s = it.Shape[0], it.Shape[1]
	ids, err := it.Int64s()
	if err != nil {
		return nil, nil, 0, 0, fmt.Errorf("input_ids: %w", err)
	}
	lab := ids
	if lt, ok := f.Tensors["labels"]; ok {
		if len(lt.Shape) != 2 || lt.Shape[0] != b || lt.Shape[1] != s {
			return nil, nil, 0, 0, fmt.Errorf("labels %v: want the shape of input_ids %v", lt.Shape, it.Shape)
		}
		if lab, err = lt.Int64s(); err != nil {
			return nil, nil, 0, 0, fmt.Errorf("labels: %w", err)
		}
	}
	inputs, targets = make([]int32, b*s), make([]int32, b*s)
	for i := range ids {
		inputs[i] = int32(ids[i])
		targets[i] = -1
		if i%s < s-1 && lab[i+1] >= 0 {
			targets[i] = int32(lab[i+1])
		}
	}
	return inputs, targets, b, s, nil
}

// keep is an ExpertGrads that keeps every layer's expert gradients.
type keep[F hfmoe.Float] struct{ gu, dn [][]F }

func (k *keep[F]) Buffers(l int) ([]F, []F, error) { return k.gu[l], k.dn[l], nil }
func (k *keep[F]) Ready(int, []F, []F) error       { return nil }

func check[F hfmoe.Float](dir, save, out string, inputs, targets []int32, b, s int) error {
	m, ck, err := hfmoe.Load[F](dir)
	if err != nil {
		return err
	}
	if save != "" {
		if err := hfmoe.Save(save, m, ck.Config, hfmoe.SaveOptions{CopyFrom: dir}); err != nil {
			return err
		}
	}
	pass, err := m.NewPass(b, s)
	if err != nil {
		return err
	}
	loss, err := pass.Forward(inputs, targets)
	if err != nil {
		return err
	}
	f32 := func(v []F) []float32 {
		o := make([]float32, len(v))
		for i, x := range v {
			o[i] = float32(x)
		}
		return o
	}
	res := map[string]safetensors.Tensor{
		"logits": safetensors.F32([]int{b, s, m.Cfg.Vocab}, f32(pass.Logits())),
		"loss":   scalar(loss.Total),
		"ce":     scalar(loss.CE),
		"aux":    scalar(loss.Aux),
	}
	k := &keep[F]{}
	for _, ly := range m.Layers {
		k.gu = append(k.gu, make([]F, ly.GateUp.Numel()))
		k.dn = append(k.dn, make([]F, ly.Down.Numel()))
	}
	if err := pass.Backward(k); err != nil {
		return err
	}
	for _, p := range m.Params() {
		if !p.Expert {
			res["grad."+p.Name] = safetensors.F32(p.Shape, f32(p.G))
		}
	}
	for l, ly := range m.Layers {
		res["grad."+ly.GateUp.Name] = safetensors.F32(ly.GateUp.Shape, f32(k.gu[l]))
		res["grad."+ly.Down.Name] = safetensors.F32(ly.Down.Shape, f32(k.dn[l]))
	}
	return safetensors.WriteFile(out, res, nil)
}

func scalar(v float64) safetensors.Tensor { return safetensors.F64([]int{1}, []float64{v}) }
