// Command sonar-train trains a byte-level Mixture-of-Experts language model
// natively in Go with the same AdamW engine sonard runs: each layer's batched
// expert tensors are updated during backward, the moment their gradients are
// final, and those gradients are freed, so at most one layer of expert
// gradients is alive. It reads real text (by default the Go standard
// library's sources), shows a one-line progress on stderr, prints the loss
// as it falls, tokens per second and the peak expert-gradient bytes. By
// default it then runs standard training (all expert gradients kept until
// backward ends) with the same seed and prints both side by side, with
// whether the parameters came out bit-for-bit equal.
//
//	sonar-train                       # both runs on the Go standard library sources
//	sonar-train --compare=false       # per-layer updates only
//	sonar-train --keep-all-grads      # the baseline only
//	sonar-train --data notes.txt --steps 500 --layers 6 --experts 16
//
// With --hf it fine-tunes a Hugging Face OLMoE or GraniteMoe checkpoint instead (package
// train/hfmoe) on token ids, and --out saves the result as a directory that
// transformers' from_pretrained loads:
//
//	sonar-train --hf ./olmoe-tiny --tokens ids.safetensors --out ./olmoe-tuned --steps 100
//
// (With --hf, --compare is off and --lr is 1e-4 unless given.)
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/sonar-moe/sonar/train/corpus"
	"github.com/sonar-moe/sonar/train/model"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// hfDefaultLR is the peak learning rate of --hf fine-tuning when --lr is
// not given: pretrained weights want a much smaller step than the byte
// model trained from scratch.
const hfDefaultLR = 1e-4

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// multiFlag collects a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// config is everything the flags set.
type config struct {
	model        model.Config
	data         []string
	ext          string
	maxBytes     int
	seq, batch   int
	steps        int
	lr           float64
	warmup       int
	minLRFrac    float64
	weightDecay  float64
	maxGradNorm  float64
	seed         uint64
	keepAll      bool
	compare      bool
	evalBatches  int
	logEvery     int
	progress     string
	logLevel     string
	maxProcs     int
	heldFraction float64
	hf           string // fine-tune this Hugging Face OLMoE or GraniteMoe checkpoint instead
	tokens       string // token ids to fine-tune it on
	out          string // where to save the fine-tuned checkpoint
	outBF16      bool
	sample       string // with --hf: random or sequential training windows
}

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{model: model.DefaultConfig()}
	fs := flag.NewFlagSet("sonar-train", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var data multiFlag
	fs.Var(&data, "data", "text file or directory to train on (repeatable); default: the Go standard library sources under `go env GOROOT`/src")
	fs.StringVar(&c.ext, "ext", "", "comma-separated file extensions to read from --data directories (default: every text file; .go for the default corpus)")
	fs.IntVar(&c.maxBytes, "max-bytes", 8<<20, "read at most this many bytes of text (files in a seeded random order)")
	fs.IntVar(&c.model.Layers, "layers", c.model.Layers, "MoE blocks")
	fs.IntVar(&c.model.Experts, "experts", c.model.Experts, "experts per block")
	fs.IntVar(&c.model.TopK, "top-k", c.model.TopK, "experts per token")
	fs.IntVar(&c.model.Hidden, "hidden", c.model.Hidden, "hidden size H")
	fs.IntVar(&c.model.Intermediate, "intermediate", c.model.Intermediate, "expert intermediate size I (gate_up [E, 2I, H], down [E, H, I])")
	fs.IntVar(&c.model.MixWindow, "mix-window", c.model.MixWindow, "tokens the causal mixing layer sees")
	fs.IntVar(&c.seq, "seq-len", 64, "bytes per sequence")
	fs.IntVar(&c.batch, "batch", 16, "sequences per step")
	fs.IntVar(&c.steps, "steps", 200, "training steps (per run)")
	fs.Float64Var(&c.lr, "lr", 3e-3, "peak learning rate (linear warmup, cosine decay); with --hf the default is 1e-4")
	fs.IntVar(&c.warmup, "warmup", 20, "warmup steps")
	fs.Float64Var(&c.minLRFrac, "min-lr-frac", 0.1, "final learning rate as a fraction of --lr")
	fs.Float64Var(&c.weightDecay, "weight-decay", 1e-2, "AdamW weight decay")
	fs.Float64Var(&c.maxGradNorm, "max-grad-norm", 1.0, "clip the dense gradients to this global norm (0: off); experts are not clipped")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the weights, the file order and the batches")
	fs.BoolVar(&c.keepAll, "keep-all-grads", false, "run only standard training: every expert gradient kept until backward ends (the baseline)")
	fs.BoolVar(&c.compare, "compare", true, "run per-layer updates, then standard training with the same seed, and print both (false: per-layer updates only); with --hf the default is false")
	fs.IntVar(&c.evalBatches, "eval-batches", 8, "held-out batches for the final held-out loss")
	fs.IntVar(&c.logEvery, "log-every", 0, "print the loss every this many steps (0: 10 lines per run)")
	fs.StringVar(&c.progress, "progress", "auto", "progress line on stderr: auto (when a terminal), on, off")
	fs.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.IntVar(&c.maxProcs, "procs", 0, "GOMAXPROCS (0: all cores)")
	fs.Float64Var(&c.heldFraction, "held-out", 0.05, "fraction of the text held out for evaluation")
	fs.StringVar(&c.hf, "hf", "", "fine-tune this Hugging Face OLMoE or GraniteMoe checkpoint (a save_pretrained directory) instead of the byte-level model; needs --tokens")
	fs.StringVar(&c.tokens, "tokens", "", "with --hf: token ids to train on (.safetensors with input_ids, or a text file of ids; see scripts/tokenize_hf.py)")
	fs.StringVar(&c.out, "out", "", "with --hf: save the fine-tuned checkpoint (of the per-layer run) to this directory")
	fs.BoolVar(&c.outBF16, "out-bf16", false, "with --out: store the weights as bfloat16 (default float32)")
	fs.StringVar(&c.sample, "sample", "random", "with --hf: training windows at seeded random offsets (random), or one after the other from the start, seq-len apart, wrapping around (sequential: another trainer can see the same batches)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	c.data = data
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if c.hf != "" {
		// Fine-tuning: one run unless --compare asks for the baseline too,
		// and a fine-tuning learning rate unless --lr says otherwise.
		if !set["compare"] {
			c.compare = false
		}
		if !set["lr"] {
			c.lr = hfDefaultLR
		}
	}
	if c.keepAll {
		if set["compare"] && c.compare {
			return nil, errors.New("--keep-all-grads runs only the baseline; --compare runs both: choose one")
		}
		c.compare = false
	}
	switch {
	case c.steps < 1:
		return nil, fmt.Errorf("--steps %d: want at least 1", c.steps)
	case c.seq < 1 || c.batch < 1:
		return nil, fmt.Errorf("--seq-len %d, --batch %d: want positive", c.seq, c.batch)
	case c.progress != "auto" && c.progress != "on" && c.progress != "off":
		return nil, fmt.Errorf("--progress %q: want auto, on or off", c.progress)
	case c.evalBatches < 0 || c.logEvery < 0 || c.maxBytes < 0:
		return nil, errors.New("--eval-batches, --log-every and --max-bytes must not be negative")
	}
	if err := c.model.Validate(); err != nil {
		return nil, err
	}
	switch {
	case c.hf != "" && c.tokens == "":
		return nil, errors.New("--hf needs --tokens (token ids of the checkpoint's tokenizer)")
	case c.hf == "" && (c.tokens != "" || c.out != "" || c.outBF16):
		return nil, errors.New("--tokens, --out and --out-bf16 go with --hf")
	case c.hf != "" && len(c.data) > 0:
		return nil, errors.New("--hf trains on --tokens, not --data")
	case c.sample != "random" && c.sample != "sequential":
		return nil, fmt.Errorf("--sample %q: want random or sequential", c.sample)
	case c.hf == "" && c.sample != "random":
		return nil, errors.New("--sample goes with --hf")
	}
	return c, nil
}

func run(args []string, stdout, stderr io.Writer) int {
	c, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintln(stderr, "sonar-train:", err)
		return exitUsage
	}
	log, err := newLogger(c.logLevel, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "sonar-train:", err)
		return exitUsage
	}
	defer log.Sync() //nolint:errcheck
	if c.maxProcs > 0 {
		runtime.GOMAXPROCS(c.maxProcs)
	}
	train := train1
	if c.hf != "" {
		train = trainHF
	}
	if err := train(c, log, stdout, stderr); err != nil {
		log.Error("training failed", zap.Error(err))
		return exitError
	}
	return exitOK
}

func newLogger(level string, w io.Writer) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	enc := zap.NewDevelopmentEncoderConfig()
	enc.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w), lvl)
	return zap.New(core), nil
}

func train1(c *config, log *zap.Logger, stdout, stderr io.Writer) error {
	var ext []string
	for _, e := range strings.Split(c.ext, ",") {
		if e = strings.TrimSpace(e); e != "" {
			if !strings.HasPrefix(e, ".") {
				e = "." + e
			}
			ext = append(ext, e)
		}
	}
	start := time.Now()
	corp, err := corpus.Load(corpus.Options{Paths: c.data, Ext: ext, MaxBytes: c.maxBytes, HeldFraction: c.heldFraction, Seed: c.seed})
	if err != nil {
		return err
	}
	log.Info("corpus loaded", zap.String("source", corp.Source), zap.Int("files", corp.Files),
		zap.Int("train_bytes", len(corp.Train)), zap.Int("held_out_bytes", len(corp.Held)), zap.Duration("took", time.Since(start)))
	modes := []bool{c.keepAll}
	if c.compare {
		modes = []bool{false, true}
	}
	prog := newProgress(stderr, c.progress)
	var results []*result
	for _, keepAll := range modes {
		r, err := runMode(c, corp, keepAll, log, stdout, prog)
		if err != nil {
			return err
		}
		results = append(results, r)
	}
	report(stdout, c, corp, results)
	return nil
}
