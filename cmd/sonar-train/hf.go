package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/sonar-moe/sonar/safetensors"
	"github.com/sonar-moe/sonar/train"
	"github.com/sonar-moe/sonar/train/hfmoe"
	"github.com/sonar-moe/sonar/train/model"
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

// tokenSampler draws windows of seq+1 consecutive tokens at seeded random
// offsets: inputs are the first seq, targets the next token of each.
type tokenSampler struct {
	toks []int32
	seq  int
	rng  *rand.Rand
}

func newTokenSampler(toks []int32, seq int, seed uint64) (*tokenSampler, error) {
	if len(toks) < seq+1 {
		return nil, fmt.Errorf("%d tokens: need at least seq-len+1 = %d", len(toks), seq+1)
	}
	return &tokenSampler{toks: toks, seq: seq, rng: rand.New(rand.NewPCG(seed, 0x70c5))}, nil
}

func (s *tokenSampler) Batch(in, tgt []int32) {
	for b := range len(in) / s.seq {
		o := s.rng.IntN(len(s.toks) - s.seq)
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
	r := &result{keepAll: keepAll}
	r.totalParams, r.expertParam = m.Counts()
	log.Info("fine-tuning", zap.String("mode", r.mode()), zap.String("model", c.hf), zap.Int("params", r.totalParams),
		zap.Int("expert_params", r.expertParam), zap.Int("batch", c.batch), zap.Int("seq_len", c.seq), zap.Int("steps", c.steps),
		zap.Int("gomaxprocs", runtimeProcs()))
	fmt.Fprintf(out, "\n== %s ==\n", r.mode())
	sched := train.Schedule{Peak: c.lr, Warmup: c.warmup, Total: c.steps, MinFrac: c.minLRFrac}
	every := c.logEvery
	if every == 0 {
		every = max(1, c.steps/10)
	}
	n := c.batch * c.seq
	in, tgt := make([]int32, n), make([]int32, n)
	var recent []float64
	var sinceSum float64
	sinceN := 0
	cpu0 := cpuTime()
	start := time.Now()
	prog.start(c.steps)
	for step := 1; step <= c.steps; step++ {
		sampler.Batch(in, tgt)
		t0 := time.Now()
		st, err := tr.Step(in, tgt, sched.LR(step))
		if err != nil {
			prog.clear()
			return nil, fmt.Errorf("step %d: %w", step, err)
		}
		r.stepTimes = append(r.stepTimes, time.Since(t0))
		r.optTime += st.Optimizer
		if math.IsNaN(st.Loss) || math.IsInf(st.Loss, 0) {
			prog.clear()
			return nil, fmt.Errorf("step %d: loss is %v", step, st.Loss)
		}
		if step == 1 {
			r.firstLoss = st.Loss
		}
		recent = append(recent, st.Loss)
		if len(recent) > 10 {
			recent = recent[1:]
		}
		r.tokens += n
		sinceSum += st.Loss
		sinceN++
		prog.update(step, st.Loss)
		if step == 1 || step%every == 0 || step == c.steps {
			prog.clear()
			fmt.Fprintf(out, "step %5d/%d  loss %.4f (mean of %3d steps)  lr %.2e  dense grad norm %6.3f  %6.0f tokens/s\n",
				step, c.steps, sinceSum/float64(sinceN), sinceN, st.LR, st.DenseGradNorm, float64(r.tokens)/time.Since(start).Seconds())
			sinceSum, sinceN = 0, 0
		}
	}
	r.elapsed = time.Since(start)
	r.cpu = cpuTime() - cpu0
	prog.clear()
	for _, v := range recent {
		r.lastLoss += v / float64(len(recent))
	}
	r.mem = tr.Memory()
	r.heldOut = math.NaN()
	if c.evalBatches > 0 && len(heldToks) > c.seq {
		hs, err := newTokenSampler(heldToks, c.seq, c.seed+1)
		if err != nil {
			return nil, err
		}
		r.heldOut = 0
		for range c.evalBatches {
			hs.Batch(in, tgt)
			l, err := tr.Eval(in, tgt)
			if err != nil {
				return nil, err
			}
			r.heldOut += l.CE / float64(c.evalBatches)
		}
	}
	var buf bytes.Buffer
	for _, p := range m.Params() {
		buf.Write(model.Bytes(p.W))
	}
	r.params = buf.Bytes()
	fmt.Fprintf(out, "loss %.4f -> %.4f (mean of last %d steps), held-out %.4f, %.0f tokens/s (%.1f s, %.1f CPU s), peak expert-grad bytes %s\n",
		r.firstLoss, r.lastLoss, len(recent), r.heldOut, r.tokensPerSec(), r.elapsed.Seconds(), r.cpu.Seconds(), layers(r.mem.Peak, r.mem.LayerBytes))
	log.Info("done", zap.String("mode", r.mode()), zap.Float64("first_loss", r.firstLoss), zap.Float64("last_loss", r.lastLoss),
		zap.Float64("held_out_loss", r.heldOut), zap.Float64("tokens_per_s", r.tokensPerSec()),
		zap.Int64("peak_expert_grad_bytes", r.mem.Peak), zap.Duration("elapsed", r.elapsed))
	return r, nil
}
