# Sonar-MoE: `make demo` runs the demo, `make test` runs every test (both set up what they need).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
GO      ?= go
export SONARD := $(CURDIR)/bin/sonard

.PHONY: all setup system-deps venv build demo test test-go test-avx512 test-py test-py-unix lint fuzz soak quality bench bench-quick clean

all: build

setup: system-deps venv

system-deps:
	@scripts/install-system-deps

# The venv is rebuilt when the pinned requirements change.
$(VENV)/.installed: requirements.txt pyclient/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e pyclient
	touch $@

venv: $(VENV)/.installed

build: system-deps
	scripts/build-go sonard

demo: setup build
	$(PY) examples/demo.py

# Go: gofmt and go vet. Python: mypy over the client package, the examples, the benchmarks, the tests and scripts/
# (settings in pyclient/pyproject.toml).
lint: system-deps venv
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(PY) -m mypy --config-file pyclient/pyproject.toml pyclient/sonar_moe examples bench tests scripts

test-go: system-deps
	$(GO) test -count=1 ./...

test-py: setup build
	$(PY) -m pytest -q --timeout=600 --durations=25 tests

# The Python suite again with every private sonard spoken to over its own Unix socket
# (unix://, SONAR_TRANSPORT=unix) instead of ZeroMQ; tests that name an ipc:// or tcp://
# address still use ZeroMQ.
test-py-unix: setup build
	SONAR_TRANSPORT=unix $(PY) -m pytest -q --timeout=600 --durations=25 tests

# The AVX-512 kernels lane for lane against the Go code, on an emulated AVX-512 CPU (Bochs, a
# Linux guest; ~1 min, installs what it needs): this project's machines lack AVX-512. GOGC=off:
# Go's garbage collector fails its own consistency check in that guest ("found pointer to free
# object") even in a program without any AVX-512 code, an emulation fault; the tests need 18 MB.
test-avx512: system-deps
	CGO_ENABLED=0 $(GO) test -c -o build/emu/optimizer.test ./optimizer
	scripts/emu-avx512 --timeout 900 --env GOGC=off build/emu/optimizer.test -test.run 'Assembly|ISA|TestMKLSqrt|NaNPayloads|DivideByRecip|EachCheck|TinyAndZero' -test.short -test.v \
		-require-isa avx512

test: lint test-go test-avx512 test-py test-py-unix

# Coverage-guided fuzzing of message decoding and request handling (the corpus is committed).
FUZZTIME ?= 10m
fuzz: system-deps
	$(GO) test -run XXX -fuzz=FuzzDecode -fuzztime=$(FUZZTIME) ./ipc/
	$(GO) test -run XXX -fuzz=FuzzHandle -fuzztime=$(FUZZTIME) ./server/

# Several trainers on one sonard for many steps; prints memory/fd/shm figures.
soak: setup build
	$(PY) scripts/soak.py --clients 4 --steps 2000

# Kernel and training benchmarks against torch (writes docs/benchmarks.md and its PNGs).
bench: setup build
	$(PY) bench/run.py $(if $(BEFORE),--before $(BEFORE))

bench-quick: setup build
	$(PY) bench/run.py --quick

# Held-out loss of Sonar vs standard AdamW with and without clipping (writes docs/quality.md).
quality: setup build
	$(PY) scripts/quality.py

clean:
	rm -rf bin
