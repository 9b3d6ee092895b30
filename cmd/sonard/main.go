// Command sonard is the Sonar-MoE server: it owns the optimizer state of
// expert tensors and applies AdamW to them when a client (the Python
// sonar_moe package) hands it a gradient in shared memory.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/sonar-moe/sonar"
	"github.com/sonar-moe/sonar/backend"
	"github.com/sonar-moe/sonar/backend/cpu"
	"github.com/sonar-moe/sonar/backend/gpu"
	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/internal/fdlimit"
	"github.com/sonar-moe/sonar/ipc"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
	"github.com/sonar-moe/sonar/optimizer/device"
	"github.com/sonar-moe/sonar/server"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Exit codes. 2 is the Go runtime's own status for a crash (a fatal error
// or an unrecovered panic), so bad flags take sysexits' EX_USAGE.
const (
	exitOK    = 0
	exitError = 1
	exitCrash = 2 // set by the Go runtime, never returned here
	exitUsage = 64
)

const usageHeader = `sonard: the Sonar-MoE server. It owns the AdamW state of Mixture-of-Experts expert tensors
and updates them when a client (the Python sonar_moe package) hands it a gradient in shared
memory. SonarAdamW starts a private sonard by itself; run one yourself to share it between
trainer processes (SonarAdamW(..., server="ipc:///path/to/sonard.sock")).

Usage: sonard [flags]

Flags (each also settable by the environment variable named in its help):
`

const usageFooter = `
Memory budget: --max-state-bytes bounds the optimizer state (exp_avg, exp_avg_sq, max_exp_avg_sq
and gradient-accumulation buffers) sonard holds in host memory for all clients together,
--max-session-state-bytes for one client. A register (or a step that starts accumulating) that
would pass either is refused with an error and changes nothing. The default of --max-state-bytes
is 75% of the memory available when sonard starts: the smaller of MemAvailable (/proc/meminfo) and
the room under its cgroup's memory.max. CUDA tensors' state is in device memory and not counted.

Exit codes:
  0   clean shutdown (SIGINT, SIGTERM or a client's shutdown message), --help, --version
  1   runtime failure (cannot bind, CUDA asked for and not usable, serve error)
  2   crash: a Go runtime fatal error or unrecovered panic (a bug of sonard; the log ends with
      the Go trace). A client's memory faults are errors of its request, never a crash.
  64  bad flags or arguments (sysexits EX_USAGE)
  killed by a signal (a shell shows 128+N; SIGKILL is often the kernel's OOM killer)
`

func main() { os.Exit(run()) }

func run() int {
	fs := flag.NewFlagSet("sonard", flag.ContinueOnError)
	listen := fs.String("listen", envOr("SONAR_LISTEN", "ipc:///tmp/sonard/sonard.sock"), "endpoint to bind: ipc:///path (ZeroMQ; socket dir 0700, socket 0600), unix:///path (sonard's own Unix stream socket, same permissions; fewer hand-overs between threads: docs/protocol.md) or tcp://host:port (ZeroMQ, needs CURVE keys) (env SONAR_LISTEN)")
	logLevel := fs.String("log-level", envOr("SONAR_LOG_LEVEL", "info"), "log level: debug, info, warn, error (env SONAR_LOG_LEVEL)")
	logFormat := fs.String("log-format", envOr("SONAR_LOG_FORMAT", "console"), "log format: console or json (env SONAR_LOG_FORMAT)")
	workers := fs.Int("workers", envInt("SONAR_WORKERS", runtime.GOMAXPROCS(0)), "goroutines per tensor update (env SONAR_WORKERS)")
	spin := fs.Duration("spin", envDuration("SONAR_SPIN", 50*time.Microsecond), "how long sonard's idle threads keep polling before they sleep: an update's worker goroutines for the next tensor, a request's wait for them, and on unix:// a connection whose requests come in quick succession for the next one (a woken thread costs tens of microseconds on a virtual CPU that halts when idle); 0: never poll (env SONAR_SPIN)")
	steer := fs.Bool("steer", envOr("SONAR_STEER", "1") != "0", "keep the workers that help a request's goroutine off its CPU while they work (on a virtual machine whose idle CPUs halt, a worker woken after an idle gap otherwise lands on that goroutine's core); SONAR_STEER=0 turns it off (env SONAR_STEER)")
	shmDir := fs.String("shm-dir", envOr("SONAR_SHM_DIR", "/dev/shm"), "directory of POSIX shared memory (env SONAR_SHM_DIR)")
	idle := fs.Duration("idle-timeout", envDuration("SONAR_IDLE_TIMEOUT", 10*time.Minute), "release the state of a client whose connection cannot be watched after this long without a request (a session normally ends --reconnect-grace after its connection closed); 0: never (env SONAR_IDLE_TIMEOUT)")
	curveSecret := fs.String("curve-secret-file", os.Getenv("SONAR_CURVE_SECRET_FILE"), "file holding the server's CURVE secret key (Z85, mode 0600); required for tcp:// (env SONAR_CURVE_SECRET_FILE)")
	curveClients := fs.String("curve-clients-file", os.Getenv("SONAR_CURVE_CLIENTS_FILE"), "file of allowed client CURVE public keys, one Z85 key per line; required for tcp:// (env SONAR_CURVE_CLIENTS_FILE)")
	genKeys := fs.String("gen-curve-keys", "", "write a new CURVE key pair to PREFIX.secret (mode 0600) and PREFIX.public, then exit")
	metricsAddr := fs.String("metrics-addr", os.Getenv("SONAR_METRICS_ADDR"), "serve Prometheus metrics over HTTP at this host:port (e.g. 127.0.0.1:9464); empty: off (env SONAR_METRICS_ADDR)")
	cudaDevice := fs.Int("cuda-device", envInt("SONAR_CUDA_DEVICE", 0), "CUDA device for clients' GPU expert tensors, used when a CUDA driver and device exist (without one sonard logs \"CUDA off\" and serves CPU tensors); -1: off (env SONAR_CUDA_DEVICE)")
	cudaLoads := fs.String("cuda-loads", envOr("SONAR_CUDA_LOADS", "scalar"), "how the CUDA kernels access a tensor's memory: scalar (one element at a time, as checked on a GPU) or vector (16 bytes a thread and array where the arrays are 16-byte aligned; checked on the CPU only so far, docs/gpu.md); both compute alike (env SONAR_CUDA_LOADS)")
	cudaMaxIdle := fs.Int("cuda-max-idle", envInt("SONAR_CUDA_MAX_IDLE", 8), "client CUDA allocations kept open while unused, for reuse (env SONAR_CUDA_MAX_IDLE)")
	trustedLibs := fs.String("trusted-sqrt-lib", os.Getenv("SONAR_TRUSTED_SQRT_LIBS"), "comma-separated libraries (absolute paths, e.g. a torch's libtorch_cpu.so) whose float32 sqrt any client may ask for, also over tcp://; clients of an ipc:// sonard may name any (env SONAR_TRUSTED_SQRT_LIBS)")
	maxState := fs.String("max-state-bytes", envOr("SONAR_MAX_STATE_BYTES", ""), "host memory for optimizer state of all clients together, e.g. 64GiB; 0: no bound (default: 75% of the memory available at start, see below) (env SONAR_MAX_STATE_BYTES)")
	maxSession := fs.String("max-session-state-bytes", envOr("SONAR_MAX_SESSION_STATE_BYTES", ""), "host memory for optimizer state of one client; 0: no bound (default: --max-state-bytes) (env SONAR_MAX_SESSION_STATE_BYTES)")
	parentPID := fs.Int("parent-pid", 0, "private server of process PID (SonarAdamW's own): exit within a second of it, however it ends; 0: a standalone server")
	runDir := fs.String("run-dir", "", "with --parent-pid: the private server's run directory (sonard.log, owner.token, the socket), removed once the parent has exited or asked for the shutdown")
	adminToken := fs.String("admin-token-file", os.Getenv("SONAR_ADMIN_TOKEN_FILE"), "file (mode 0600) of the secret a shutdown request must carry; without it shutdown is refused (stop sonard with SIGTERM) (env SONAR_ADMIN_TOKEN_FILE)")
	grace := fs.Duration("reconnect-grace", envDuration("SONAR_RECONNECT_GRACE", server.DefaultReconnectGrace), "keep a session this long after its connection closed, for its client to reconnect (env SONAR_RECONNECT_GRACE)")
	heartbeat := fs.Duration("heartbeat-timeout", envDuration("SONAR_HEARTBEAT_TIMEOUT", 10*time.Second), "close a connection that answers no heartbeat (sent every second) for this long; its session is then released (env SONAR_HEARTBEAT_TIMEOUT)")
	mklSqrt := fs.String("mkl-sqrt", envOr("SONAR_MKL_SQRT", "auto"), "how sonard reproduces the float32 sqrt of a client's MKL (vmsSqrt): auto (its own emulation of MKL's arithmetic where a check at load finds one bitwise equal to the library's on 52 million chosen inputs, else calls into the library) or call (always call the library) (env SONAR_MKL_SQRT)")
	isa := fs.String("isa", os.Getenv("SONAR_ISA"), "widest vector instruction set of the CPU update kernels: avx512vbmi, avx512bf16, avx512, avx2 or go (all bitwise alike; default: the CPU's widest) (env SONAR_ISA)")
	version := fs.Bool("version", false, "print the version and exit")
	fs.SetOutput(os.Stdout)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageHeader)
		fs.PrintDefaults()
		fmt.Fprint(fs.Output(), usageFooter)
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "sonard: unexpected arguments %q (see --help)\n", fs.Args())
		return exitUsage
	}
	if *version {
		fmt.Printf("sonard %s (protocol %d)\n", sonar.Version, ipc.Version)
		return exitOK
	}
	if *genKeys != "" {
		if err := writeKeyPair(*genKeys); err != nil {
			fmt.Fprintln(os.Stderr, "sonard:", err)
			return exitError
		}
		return exitOK
	}
	curve, err := loadCurve(*curveSecret, *curveClients)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sonard:", err)
		return exitUsage
	}
	if err := ipc.CheckEndpoint(*listen, curve != nil); err != nil {
		fmt.Fprintf(os.Stderr, "sonard: --listen: %v (tcp:// needs --curve-secret-file and --curve-clients-file, see --gen-curve-keys)\n", err)
		return exitUsage
	}
	if *isa != "" {
		l, err := optimizer.ParseISA(*isa)
		if err != nil {
			fmt.Fprintln(os.Stderr, "sonard: --isa:", err)
			return exitUsage
		}
		optimizer.LimitISA(l)
	}
	loads, err := device.ParseLoads(*cudaLoads)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sonard: --cuda-loads:", err)
		return exitUsage
	}
	if *mklSqrt != "auto" && *mklSqrt != "call" {
		fmt.Fprintf(os.Stderr, "sonard: --mkl-sqrt %q: want auto or call\n", *mklSqrt)
		return exitUsage
	}
	budget, sessionBudget, err := stateBudgets(*maxState, *maxSession)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sonard:", err)
		return exitUsage
	}
	log, err := newLogger(*logLevel, *logFormat)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sonard:", err)
		return exitUsage
	}
	defer log.Sync() //nolint:errcheck

	// MKL (a client's libtorch_cpu.so, loaded for its float32 sqrt) must
	// not start threads of its own inside the engine's goroutines.
	if os.Getenv("MKL_NUM_THREADS") == "" {
		_ = os.Setenv("MKL_NUM_THREADS", "1")
	}
	cudaExplicit := os.Getenv("SONAR_CUDA_DEVICE") != ""
	fs.Visit(func(f *flag.Flag) { cudaExplicit = cudaExplicit || f.Name == "cuda-device" })
	gpuBackend, announceCUDA, err := openCUDA(log, *cudaDevice, *cudaMaxIdle, loads, cudaExplicit)
	if err != nil {
		log.Error("CUDA", zap.Error(err))
		return exitError
	}
	cpuBackend := cpu.New(ipcbridge.ShmMapper{Dir: *shmDir, Unlink: true}, *workers)
	cpuBackend.Spin = *spin
	cpuBackend.Steer = *steer
	if *spin <= 0 {
		cpuBackend.Spin = -1 // the engine's "never"
	}
	backends := []backend.Backend{cpuBackend}
	if gpuBackend != nil {
		backends = append(backends, gpuBackend)
	}
	srv := server.New(log, backends...)
	srv.Unavailable("cuda", "no CUDA driver or device, or started with --cuda-device -1: use CPU expert tensors")
	srv.Workers = *workers
	srv.IdleTimeout = *idle
	srv.MaxStateBytes, srv.MaxSessionStateBytes = budget, sessionBudget
	srv.ReconnectGrace = *grace
	fds, err := fdlimit.Read()
	if err != nil {
		log.Error("file descriptor limits", zap.Error(err))
		return exitError
	}
	srv.MaxSegments, srv.MaxSessionSegments = fds.Segments, fds.SessionSegments
	if *adminToken != "" {
		if srv.AdminToken, err = readToken(*adminToken); err != nil {
			fmt.Fprintln(os.Stderr, "sonard:", err)
			return exitUsage
		}
	}
	srv.LoadSqrt = (&sqrtLoader{log: log, emulate: *mklSqrt == "auto", workers: *workers}).load
	srv.LocalClients = strings.HasPrefix(*listen, "ipc://") || strings.HasPrefix(*listen, "unix://")
	srv.TrustedSqrtLibs = map[string]bool{}
	for _, lib := range strings.Split(*trustedLibs, ",") {
		if lib = strings.TrimSpace(lib); lib != "" {
			if !filepath.IsAbs(lib) {
				fmt.Fprintf(os.Stderr, "sonard: --trusted-sqrt-lib %q: want an absolute path\n", lib)
				return exitUsage
			}
			srv.TrustedSqrtLibs[lib] = true
		}
	}
	defer srv.Close() // sessions first (they hold mappings and device state), then the backends
	// Signals are caught before the socket exists: whoever sees it may stop the server at once
	// and still get a clean exit. They stay caught until the process ends (no signal.Stop): a
	// signal that lands while sonard is already stopping (a client's shutdown first, then a
	// signal to the process group or from a service manager) would otherwise kill it mid-way
	// through its clean stop (exit -2, not 0).
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tr, err := ipc.Open(*listen, log, curve, ipc.Options{HeartbeatTimeout: *heartbeat, Poll: *spin, MaxConns: fds.Conns})
	if err != nil {
		log.Error("listen failed", zap.Error(err))
		return exitError
	}
	srv.Peers = tr // a client's process id, for attach_process
	var parentGone <-chan struct{}
	if *parentPID != 0 {
		if parentGone, err = watchParent(*parentPID, log); err != nil {
			log.Error("parent", zap.Error(err))
			return exitError
		}
	}
	go func() {
		select {
		case <-srv.Done():
		case <-parentGone:
		case s := <-signals:
			log.Info("stopping on a signal", zap.Stringer("signal", s))
		}
		cancel()
		for s := range signals {
			log.Info("already stopping; signal ignored", zap.Stringer("signal", s))
		}
	}()
	if *metricsAddr != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", srv.MetricsHandler())
		hs := &http.Server{Addr: *metricsAddr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		ln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			log.Error("metrics listen failed", zap.Error(err))
			return exitError
		}
		go func() { _ = hs.Serve(ln) }()
		defer hs.Close()
		log.Info("metrics", zap.String("url", "http://"+ln.Addr().String()+"/metrics"))
	}
	log.Info("sonard listening", zap.String("addr", *listen), zap.String("version", sonar.Version),
		zap.Int("protocol", ipc.Version), zap.Int("workers", *workers), zap.Duration("spin", *spin), zap.Bool("steer", *steer), zap.Int("pid", os.Getpid()),
		zap.Stringer("isa", optimizer.KernelISA()), zap.Stringer("cpu_isa", optimizer.CPUISA()),
		zap.String("max_state_bytes", budgetString(budget)), zap.String("max_session_state_bytes", budgetString(sessionBudget)))
	announceCUDA() // after "sonard listening", which stays the first line
	log.Info("limits from RLIMIT_NOFILE", zap.Uint64("nofile", fds.NoFile), zap.Uint64("nofile_hard", fds.NoFileMax),
		zap.Int("max_map_count", fds.MapCount), zap.Int("reserved_fds", fds.Reserve), zap.Int("max_segments", fds.Segments),
		zap.Int("max_session_segments", fds.SessionSegments), zap.Int("max_connections", fds.Conns))
	// The main goroutine stays locked to the main thread (parent.go); the
	// loop runs on a goroutine of its own. A locked goroutine that blocks (the
	// engine's caller waiting for its workers) or yields (ipc/activity.go)
	// hands its processor to another thread and must be handed back, two
	// thread wake-ups each time.
	served := make(chan error, 1)
	go func() { served <- tr.Serve(ctx, srv) }()
	serveErr := <-served
	if err := tr.Close(); err != nil {
		log.Warn("closing socket", zap.Error(err))
	}
	if serveErr != nil {
		log.Error("serve failed", zap.Error(serveErr))
		return exitError
	}
	log.Info("sonard stopped")
	if parentGone != nil && *runDir != "" {
		select {
		case <-parentGone:
			removeRunDir(*runDir, log)
		case <-srv.Done():
			// The owner asked for the stop (its token): it is done with the directory, and a
			// client interrupted between its shutdown and its own removal (Ctrl-C while
			// close() waited) left it behind.
			removeRunDir(*runDir, log)
		default:
		}
	}
	return exitOK
}

// stateBudgets reads --max-state-bytes and --max-session-state-bytes ("":
// their defaults).
func stateBudgets(total, session string) (int64, int64, error) {
	t := defaultStateBudget()
	if total != "" {
		n, err := parseBytes(total)
		if err != nil {
			return 0, 0, fmt.Errorf("--max-state-bytes %w", err)
		}
		t = n
	}
	s := t
	if session != "" {
		n, err := parseBytes(session)
		if err != nil {
			return 0, 0, fmt.Errorf("--max-session-state-bytes %w", err)
		}
		s = n
	}
	return t, s, nil
}

func budgetString(n int64) string {
	if n <= 0 {
		return "no bound"
	}
	return server.FormatBytes(n)
}

// openCUDA opens the CUDA backend on device ordinal (-1: off). Without a
// driver (or, unless asked for explicitly, without the device) it returns
// no backend and no error; other failures (NVRTC missing, kernels not
// loading) are errors when the device was asked for explicitly, and "CUDA
// off" otherwise. announce logs the outcome.
func openCUDA(log *zap.Logger, ordinal, maxIdle int, loads device.Loads, explicit bool) (*gpu.Backend, func(), error) {
	off := func(level zapcore.Level, reason string) func() {
		return func() { log.Log(level, "CUDA off: "+reason) }
	}
	if ordinal < 0 {
		return nil, off(zapcore.InfoLevel, "--cuda-device -1"), nil
	}
	if maxIdle < 0 {
		return nil, nil, fmt.Errorf("--cuda-max-idle %d: want >= 0", maxIdle)
	}
	b, err := gpu.Open(ordinal, maxIdle, loads)
	if err != nil {
		if errors.Is(err, gpu.ErrNoCUDA) && (!explicit || errors.Is(err, cuda.ErrNoDriver)) {
			return nil, off(zapcore.InfoLevel, err.Error()), nil
		}
		if explicit {
			return nil, nil, err
		}
		return nil, off(zapcore.WarnLevel, err.Error()), nil
	}
	return b, func() {
		log.Info("CUDA on", zap.String("device", b.Describe()), zap.Int("ordinal", ordinal), zap.Int("max_idle", maxIdle))
	}, nil
}

func newLogger(level, format string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	var cfg zap.Config
	switch format {
	case "json":
		cfg = zap.NewProductionConfig()
	case "console":
		cfg = zap.NewDevelopmentConfig()
		cfg.DisableStacktrace = true
	default:
		return nil, fmt.Errorf("--log-format %q: want console or json", format)
	}
	cfg.Level = zap.NewAtomicLevelAt(lvl)
	cfg.OutputPaths = []string{"stderr"}
	return cfg.Build()
}

// writeKeyPair writes a CURVE key pair: PREFIX.secret (0600) and PREFIX.public.
func writeKeyPair(prefix string) error {
	pub, sec, err := zmq.NewCurveKeypair()
	if err != nil {
		return fmt.Errorf("generate CURVE keys: %w", err)
	}
	if err := os.WriteFile(prefix+".secret", []byte(sec+"\n"), 0o600); err != nil {
		return fmt.Errorf("write secret key: %w", err)
	}
	if err := os.WriteFile(prefix+".public", []byte(pub+"\n"), 0o644); err != nil {
		return fmt.Errorf("write public key: %w", err)
	}
	return nil
}

// loadCurve reads the server secret key and the allowed client keys; nil
// when neither file is given.
func loadCurve(secretFile, clientsFile string) (*ipc.Curve, error) {
	if secretFile == "" && clientsFile == "" {
		return nil, nil
	}
	if secretFile == "" || clientsFile == "" {
		return nil, fmt.Errorf("CURVE needs both --curve-secret-file and --curve-clients-file")
	}
	st, err := os.Stat(secretFile)
	if err != nil {
		return nil, fmt.Errorf("curve secret: %w", err)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("curve secret %s has mode %o: want 0600", secretFile, st.Mode().Perm())
	}
	sec, err := os.ReadFile(secretFile)
	if err != nil {
		return nil, fmt.Errorf("curve secret: %w", err)
	}
	c := &ipc.Curve{ServerSecret: strings.TrimSpace(string(sec))}
	if len(c.ServerSecret) != 40 {
		return nil, fmt.Errorf("curve secret %s: want a 40-character Z85 key", secretFile)
	}
	keys, err := os.ReadFile(clientsFile)
	if err != nil {
		return nil, fmt.Errorf("curve clients: %w", err)
	}
	for _, line := range strings.Split(string(keys), "\n") {
		if k := strings.TrimSpace(line); k != "" && !strings.HasPrefix(k, "#") {
			if len(k) != 40 {
				return nil, fmt.Errorf("curve clients %s: %q is not a 40-character Z85 key", clientsFile, k)
			}
			c.ClientKeys = append(c.ClientKeys, k)
		}
	}
	if len(c.ClientKeys) == 0 {
		return nil, fmt.Errorf("curve clients %s: no keys", clientsFile)
	}
	return c, nil
}

func envOr(key, def string) string {
	if v, ok := os.LookupEnv(key); ok && v != "" {
		return v
	}
	return def
}

func envInt(key string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(key)); err == nil {
		return v
	}
	return def
}

func envDuration(key string, def time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv(key)); err == nil {
		return v
	}
	return def
}
