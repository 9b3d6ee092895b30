package main

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"

	"github.com/sonar-moe/sonar/safetensors"
	"github.com/sonar-moe/sonar/train"
	"github.com/sonar-moe/sonar/train/hfmoe"
	"go.uber.org/zap"
)

// Fine-tuning a Hugging Face OLMoE or GraniteMoe checkpoint (--hf): the model is loaded
// from a save_pretrained directory, trained on token ids (--tokens) with the
// same per-layer expert updates, and written back (--out) as a directory
// transformers loads.

// readTokens reads token ids: a .safetensors file's "input_ids" tensor (any
// shape and integer dtype, flattened in order), or a text file of ids
// separated by white space.
func readTokens(path string) ([]int32, error) {
	if strings.HasSuffix(path, ".safetensors") {
		f, err := safetensors.ReadFile(path)
		if err != nil {
			return nil, err
		}
		t, ok := f.Tensors["input_ids"]
		if !ok {
			return nil, fmt.Errorf("%s: no input_ids tensor", path)
		}
		ids, err := t.Int64s()
		if err != nil {
			return nil, fmt.Errorf("%s: input_ids: %w", path, err)
		}
		out := make([]int32, len(ids))
		for i, v := range ids {
			if v < 0 || v > math.MaxInt32 {
				return nil, fmt.Errorf("%s: token %d at %d", path, v, i)
			}
			out[i] = int32(v)
		}
		return out, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Split(bufio.ScanWords)
	var out []int32
	for sc.Scan() {
		v, err := strconv.ParseInt(sc.Text(), 10, 32)
		if err != nil || v < 0 {
			return nil, fmt.Errorf("%s: token %d: %q is not a token id", path, len(out), sc.Text())
		}
		out = append(out, int32(v))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// tokenSampler draws windows of seq+1 consecutive tokens: inputs are the
// first seq, targets the next token of each. Windows start at seeded random
// offsets, or, when sequential, at 0, seq, 2*seq, ... as long as a whole
// window fits, then from 0 again (window i at (i mod ((len-1)/seq))*seq).
type tokenSampler struct {
	toks       []int32
	seq        int
	rng        *rand.Rand
	sequential bool
	next       int // windows drawn so far (sequential)
}

func newTokenSampler(toks []int32, seq int, seed uint64) (*tokenSampler, error) {
	if len(toks) < seq+1 {
		return nil, fmt.Errorf("%d tokens: need at least seq-len+1 = %d", len(toks), seq+1)
	}
	return &tokenSampler{toks: toks, seq: seq, rng: rand.New(rand.NewPCG(seed, 0x70c5))}, nil
}

func (s *tokenSampler) Batch(in, tgt []int32) {
	for b := range len(in) / s.seq {
		var o int
		if s.sequential {
			o = s.next % ((len(s.toks) - 1) / s.seq) * s.seq
			s.next++
		} else {
			o = s.rng.IntN(len(s.toks) - s.seq)
		}
		copy(in[b*s.seq:(b+1)*s.seq], s.toks[o:o+s.seq])
		copy(tgt[b*s.seq:(b+1)*s.seq], s.toks[o+1:o+s.seq+1])
	}
}

func trainHF(c *config, log *zap.Logger, stdout, stderr io.Writer) error {
	toks, err := readTokens(c.tokens)
	if err != nil {
		return fmt.Errorf("--tokens: %w", err)
	}
	held := int(float64(len(toks)) * c.heldFraction)
	if held < c.seq+1 {
		held = 0
	}
	trainToks, heldToks := toks[:len(toks)-held], toks[len(toks)-held:]
	log.Info("tokens loaded", zap.String("path", c.tokens), zap.Int("train", len(trainToks)), zap.Int("held_out", len(heldToks)))
	modes := []bool{c.keepAll}
	if c.compare {
		modes = []bool{false, true}
	}
	prog := newProgress(stderr, c.progress)
	var results []*result
	var cfg hfmoe.Config
	for i, keepAll := range modes {
		m, ck, err := hfmoe.Load[float32](c.hf)
		if err != nil {
			return err
		}
		cfg = m.Cfg
		r, err := runHFMode(c, m, trainToks, heldToks, keepAll, log, stdout, prog)
		if err != nil {
			return err
		}
		results = append(results, r)
		if i == 0 && c.out != "" {
			if err := hfmoe.Save(c.out, m, ck.Config, hfmoe.SaveOptions{BF16: c.outBF16, CopyFrom: c.hf}); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "saved the fine-tuned model to %s\n", c.out)
		}
	}
	r0 := results[0]
	fmt.Fprintf(stdout, "\nmodel: %s (%s): %d layers x %d experts (top-%d), hidden %d, intermediate %d, vocab %d: %s parameters, %s in experts (%.0f%%)\n",
		c.hf, cfg.Arch, cfg.Layers, cfg.Experts, cfg.TopK, cfg.Hidden, cfg.Intermediate, cfg.Vocab,
		count(r0.totalParams), count(r0.expertParam), 100*float64(r0.expertParam)/float64(r0.totalParams))
	fmt.Fprintf(stdout, "data: %s, %d train / %d held-out tokens; %d steps of %d x %d tokens\n\n", c.tokens, len(trainToks), len(heldToks), c.steps, c.batch, c.seq)
	printTable(stdout, results)
	return nil
}

func runHFMode(c *config, m *hfmoe.Model[float32], trainToks, heldToks []int32, keepAll bool, log *zap.Logger, out io.Writer, prog *progress) (*result, error) {
	for i, t := range trainToks {
		if int(t) >= m.Cfg.Vocab {
			return nil, fmt.Errorf("--tokens: token %d at %d is outside the vocabulary (%d)", t, i, m.Cfg.Vocab)
		}
	}
	for i, t := range heldToks {
		if int(t) >= m.Cfg.Vocab {
			return nil, fmt.Errorf("--tokens: token %d at %d is outside the vocabulary (%d)", t, len(trainToks)+i, m.Cfg.Vocab)
		}
	}
	opts := train.Options{Hyper: train.DefaultHyper(), MaxGradNorm: c.maxGradNorm, KeepAllGrads: keepAll}
	opts.Hyper.LR, opts.Hyper.WeightDecay = c.lr, c.weightDecay
	tr, err := train.NewHF(m, c.batch, c.seq, opts)
	if err != nil {
		return nil, err
	}
	sampler, err := newTokenSampler(trainToks, c.seq, c.seed)
	if err != nil {
		return nil, fmt.Errorf("--tokens: %w", err)
	}
	sampler.sequential = c.sample == "sequential"
	r := &result{keepAll: keepAll}
	r.totalParams, r.expertParam = m.Counts()
	log.Info("fine-tuning", zap.String("mode", r.mode()), zap.String("model", c.hf), zap.Int("params", r.totalParams),
		zap.Int("expert_params", r.expertParam), zap.Int("batch", c.batch), zap.Int("seq_len", c.seq), zap.Int("steps", c.steps),
		zap.Int("gomaxprocs", runtimeProcs()))
	var held batcher
	if c.evalBatches > 0 && len(heldToks) > c.seq {
		if held, err = newTokenSampler(heldToks, c.seq, c.seed+1); err != nil {
			return nil, err
		}
	}
	if err := loop(c, tr, sampler, held, r, log, out, prog); err != nil {
		return nil, err
	}
	return r, nil
}
