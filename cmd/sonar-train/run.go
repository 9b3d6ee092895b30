package main

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/sonar-moe/sonar/train"
	"github.com/sonar-moe/sonar/train/corpus"
	"github.com/sonar-moe/sonar/train/kernels"
	"github.com/sonar-moe/sonar/train/model"
	"go.uber.org/zap"
)

// result is what one training run measured.
type result struct {
	keepAll     bool
	firstLoss   float64
	lastLoss    float64 // mean of the last steps
	heldOut     float64
	tokens      int
	elapsed     time.Duration
	cpu         time.Duration // process CPU time (user+sys) of the training loop
	stepTimes   []time.Duration
	optTime     time.Duration // after-backward optimizer time, summed
	mem         train.Memory
	params      []byte // every parameter's bytes at the end, for --compare
	totalParams int
	expertParam int
}

func (r *result) mode() string {
	if r.keepAll {
		return "keep all expert grads (standard)"
	}
	return "per-layer updates in backward (sonar)"
}

func (r *result) tokensPerSec() float64 { return float64(r.tokens) / r.elapsed.Seconds() }

func runMode(c *config, corp *corpus.Corpus, keepAll bool, log *zap.Logger, out io.Writer, prog *progress) (*result, error) {
	m, err := model.New(c.model, c.seed)
	if err != nil {
		return nil, err
	}
	opts := train.Options{Hyper: train.DefaultHyper(), MaxGradNorm: c.maxGradNorm, KeepAllGrads: keepAll}
	opts.Hyper.LR, opts.Hyper.WeightDecay = c.lr, c.weightDecay
	tr, err := train.New(m, c.batch, c.seq, opts)
	if err != nil {
		return nil, err
	}
	sampler, err := corpus.NewSampler(corp.Train, c.seq, c.seed)
	if err != nil {
		return nil, err
	}
	r := &result{keepAll: keepAll}
	r.totalParams, r.expertParam = m.Counts()
	log.Info("training", zap.String("mode", r.mode()), zap.Int("layers", c.model.Layers), zap.Int("experts", c.model.Experts),
		zap.Int("top_k", c.model.TopK), zap.Int("hidden", c.model.Hidden), zap.Int("intermediate", c.model.Intermediate),
		zap.Int("params", r.totalParams), zap.Int("expert_params", r.expertParam), zap.Int("batch", c.batch),
		zap.Int("seq_len", c.seq), zap.Int("steps", c.steps), zap.Int("gomaxprocs", runtimeProcs()))
	var held batcher
	if c.evalBatches > 0 && len(corp.Held) > c.seq {
		if held, err = corpus.NewSampler(corp.Held, c.seq, c.seed+1); err != nil {
			return nil, err
		}
	}
	if err := loop(c, tr, sampler, held, r, log, out, prog); err != nil {
		return nil, err
	}
	return r, nil
}

// batcher fills a batch of inputs and their next-token targets.
type batcher interface{ Batch(inputs, targets []int32) }

// loop runs c.steps training steps of tr on batches from data, then the
// held-out loss (cross-entropy) on c.evalBatches batches from held (NaN
// without), and fills r: losses, times, memory and, for --compare, the bytes
// of every weight at the end.
func loop(c *config, tr *train.Trainer, data, held batcher, r *result, log *zap.Logger, out io.Writer, prog *progress) error {
	fmt.Fprintf(out, "\n== %s ==\n", r.mode())
	sched := train.Schedule{Peak: c.lr, Warmup: c.warmup, Total: c.steps, MinFrac: c.minLRFrac}
	every := c.logEvery
	if every == 0 {
		every = max(1, c.steps/10)
	}
	n := c.batch * c.seq
	in, tgt := make([]int32, n), make([]int32, n)
	var recent []float64
	var sinceSum float64 // losses since the last printed line
	sinceN := 0
	cpu0 := cpuTime()
	start := time.Now()
	prog.start(c.steps)
	for step := 1; step <= c.steps; step++ {
		data.Batch(in, tgt)
		t0 := time.Now()
		st, err := tr.Step(in, tgt, sched.LR(step))
		if err != nil {
			prog.clear()
			return fmt.Errorf("step %d: %w", step, err)
		}
		r.stepTimes = append(r.stepTimes, time.Since(t0))
		r.optTime += st.Optimizer
		if math.IsNaN(st.Loss) || math.IsInf(st.Loss, 0) {
			prog.clear()
			return fmt.Errorf("step %d: loss is %v", step, st.Loss)
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
	if held != nil {
		r.heldOut = 0
		for range c.evalBatches {
			held.Batch(in, tgt)
			l, err := tr.Eval(in, tgt)
			if err != nil {
				return err
			}
			r.heldOut += l.CE / float64(c.evalBatches)
		}
	}
	var buf bytes.Buffer
	for _, w := range tr.Weights() {
		buf.Write(kernels.Bytes(w))
	}
	r.params = buf.Bytes()
	fmt.Fprintf(out, "loss %.4f -> %.4f (mean of last %d steps), held-out %.4f, %.0f tokens/s (%.1f s, %.1f CPU s), peak expert-grad bytes %s\n",
		r.firstLoss, r.lastLoss, len(recent), r.heldOut, r.tokensPerSec(), r.elapsed.Seconds(), r.cpu.Seconds(), layers(r.mem.Peak, r.mem.LayerBytes))
	log.Info("done", zap.String("mode", r.mode()), zap.Float64("first_loss", r.firstLoss), zap.Float64("last_loss", r.lastLoss),
		zap.Float64("held_out_loss", r.heldOut), zap.Float64("tokens_per_s", r.tokensPerSec()),
		zap.Int64("peak_expert_grad_bytes", r.mem.Peak), zap.Duration("elapsed", r.elapsed))
	return nil
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// report prints the summary (a table with --compare).
func report(out io.Writer, c *config, corp *corpus.Corpus, rs []*result) {
	r0 := rs[0]
	fmt.Fprintf(out, "\nmodel: %d layers x %d experts (top-%d), hidden %d, intermediate %d: %s parameters, %s in experts (%.0f%%)\n",
		c.model.Layers, c.model.Experts, c.model.TopK, c.model.Hidden, c.model.Intermediate,
		count(r0.totalParams), count(r0.expertParam), 100*float64(r0.expertParam)/float64(r0.totalParams))
	fmt.Fprintf(out, "data: %s, %d files, %s train / %s held out; %d steps of %d x %d bytes\n",
		corp.Source, corp.Files, size(int64(len(corp.Train))), size(int64(len(corp.Held))), c.steps, c.batch, c.seq)
	fmt.Fprintln(out)
	printTable(out, rs)
}

// printTable prints the runs' figures as a table and, for two runs, whether
// they ended with the same parameter bits.
func printTable(out io.Writer, rs []*result) {
	fmt.Fprintln(out, "| mode | loss first -> last | held-out loss | tokens/s | median step ms | CPU s | peak expert-grad bytes |")
	fmt.Fprintln(out, "|---|---|---|---|---|---|---|")
	for _, r := range rs {
		fmt.Fprintf(out, "| %s | %.4f -> %.4f | %.4f | %.0f | %.1f | %.1f | %s |\n", r.mode(), r.firstLoss, r.lastLoss, r.heldOut,
			r.tokensPerSec(), float64(median(r.stepTimes).Microseconds())/1000, r.cpu.Seconds(), layers(r.mem.Peak, r.mem.LayerBytes))
	}
	if len(rs) == 2 {
		eq := "yes"
		if !bytes.Equal(rs[0].params, rs[1].params) {
			eq = "NO"
		}
		fmt.Fprintf(out, "\nparams bitwise equal: %s\n", eq)
	}
}

func layers(b, layer int64) string {
	if layer == 0 {
		return size(b)
	}
	n := float64(b) / float64(layer)
	unit := "layers"
	if n == 1 {
		unit = "layer"
	}
	return fmt.Sprintf("%s (%g %s)", size(b), n, unit)
}

func size(b int64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}

func count(n int) string {
	if n >= 1e6 {
		return fmt.Sprintf("%.2fM", float64(n)/1e6)
	}
	return fmt.Sprintf("%.1fk", float64(n)/1e3)
}

// progress is a single status line on stderr, redrawn in place.
type progress struct {
	w       io.Writer
	on      bool
	total   int
	began   time.Time
	last    time.Time
	visible bool
}

func newProgress(w io.Writer, mode string) *progress {
	on := mode == "on"
	if mode == "auto" {
		if f, ok := w.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				on = true
			}
		}
	}
	return &progress{w: w, on: on}
}

func (p *progress) start(total int) {
	p.total, p.began, p.last = total, time.Now(), time.Time{}
}

func (p *progress) update(step int, loss float64) {
	if !p.on || (time.Since(p.last) < 100*time.Millisecond && step != p.total) {
		return
	}
	p.last = time.Now()
	el := time.Since(p.began).Seconds()
	width := 30
	done := width * step / p.total
	fmt.Fprintf(p.w, "\r[%s%s] step %d/%d  %.1f steps/s  loss %.4f ", strings.Repeat("=", done), strings.Repeat(" ", width-done),
		step, p.total, float64(step)/el, loss)
	p.visible = true
}

func (p *progress) clear() {
	if p.on && p.visible {
		fmt.Fprint(p.w, "\r\033[K")
		p.visible = false
	}
}

func runtimeProcs() int { return runtime.GOMAXPROCS(0) }

// cpuTime is the process's CPU time so far (user + system): on a shared
// machine it says what the run cost when wall-clock time does not.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
